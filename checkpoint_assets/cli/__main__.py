"""``python -m checkpoint_assets.cli``: the ``checkpoint-assets`` command."""

from checkpoint_assets.cli import main

raise SystemExit(main())
