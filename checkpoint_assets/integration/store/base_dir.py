"""Where checkpoints go when ``CheckpointIOManager`` has no ``base_dir``: the Dagster home's
``checkpoints`` folder, never a folder that is deleted after the run."""

from __future__ import annotations

import os
import tempfile

import dagster as dg

from checkpoint_assets.engine.errors import CheckpointError


def default_base_dir(instance: dg.DagsterInstance | None) -> str | None:
    """Where checkpoints go when ``base_dir`` is not given: ``$DAGSTER_HOME/checkpoints``, else
    under the instance's storage folder.

    Refuses a home that is deleted after the run: every checkpoint would be lost with it, and
    nothing would ever resume. Such homes are an ephemeral instance, a temporary folder, and the
    temporary instance that ``dagster asset materialize`` makes without ``DAGSTER_HOME``.
    """
    home = os.environ.get("DAGSTER_HOME")
    if home:
        if is_temporary_folder(home):
            raise _temporary_home(f"DAGSTER_HOME is the temporary folder {home}")
        return os.path.join(home, "checkpoints")
    if instance is None:
        return None
    if instance.is_ephemeral:
        raise _temporary_home("the Dagster instance is ephemeral (in memory, DAGSTER_HOME unset)")
    if is_temporary_folder(instance.root_directory):
        raise _temporary_home(
            f"the Dagster instance lives in the temporary folder {instance.root_directory} "
            "(DAGSTER_HOME unset)"
        )
    return os.path.join(instance.storage_directory(), "checkpoints")


# The folder `dagster` CLI commands make in the current directory without DAGSTER_HOME, and
# delete when they exit (dagster._cli.utils.TMP_DAGSTER_HOME_PREFIX).
_DAGSTER_TEMP_HOME = ".tmp_dagster_home_"


def is_temporary_folder(path: str) -> bool:
    """Is ``path`` a folder that is deleted when its process ends?

    Two kinds are: one that ``dagster`` CLI commands make without ``DAGSTER_HOME``, and one that
    ``tempfile`` makes directly in the system's temporary folder (``DagsterInstance.local_temp()``,
    ``instance_for_test()``).
    """
    real = os.path.realpath(path)
    name = os.path.basename(real)
    if name.startswith(_DAGSTER_TEMP_HOME):
        return True
    system_temp = os.path.realpath(tempfile.gettempdir())
    return os.path.dirname(real) == system_temp and name.startswith(tempfile.template)


def _temporary_home(why: str) -> CheckpointError:
    return CheckpointError(
        f"CheckpointIOManager has no base_dir and {why}: the default base_dir, a "
        "'checkpoints' folder in it, would be deleted after the run with every checkpoint, and "
        "nothing would ever resume. The step stopped before computing anything.",
        "Set DAGSTER_HOME to an existing folder (e.g. `mkdir -p ~/dagster_home && export "
        "DAGSTER_HOME=~/dagster_home`), or give CheckpointIOManager(base_dir=...) a lasting "
        "local path or URI.",
    )
