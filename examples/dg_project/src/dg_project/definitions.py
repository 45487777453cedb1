from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    """Everything under defs/: the tickets asset, the IO manager and the YAML component."""
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
