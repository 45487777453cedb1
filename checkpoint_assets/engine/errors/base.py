"""``CheckpointError``, the base of every error: what happened, then what to do.

Each class words its own remedy twice: ``engine_remedy`` in the engine's terms, ``dagster_remedy``
in Dagster's. The package's ``__init__`` says how they are chosen.
"""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Base class of every error raised by checkpoint-assets: what happened, then what to do.

    Raised as itself for problems of setup. A batch function whose signature cannot be called.
    A source that is not a table. An IO manager that is not a ``CheckpointIOManager``.
    ``global_resume: true`` before ``<asset>_global_resume`` is materialized. An unset variable
    of a ``{"env": "VAR"}`` storage option. A partition loaded before it was checkpointed.
    ``usage_columns`` that are not numeric outputs. A run whose checkpoints would live in a
    temporary Dagster instance. Catch ``CheckpointError`` to handle every error of the package.
    """

    def __init__(self, what: str, remedy: str | None = None) -> None:
        super().__init__(what)
        self.what = what
        self._given = remedy  # said where it was raised; None: the class's own
        self._dagster = False  # the class's own remedy in Dagster's terms

    def __str__(self) -> str:
        return f"{self.what} {self.remedy}".strip()

    @property
    def remedy(self) -> str:
        """What to do: the one given where the error was raised, else the class's own."""
        if self._given is not None:
            return self._given
        return self.dagster_remedy() if self._dagster else self.engine_remedy()

    @remedy.setter
    def remedy(self, remedy: str) -> None:
        self._given = remedy

    def engine_remedy(self) -> str:
        """The class's remedy in the engine's terms (settings, the CLI)."""
        return ""

    def dagster_remedy(self) -> str:
        """The class's remedy in Dagster's terms (run config keys, ``code_version``, the
        sensor); the engine's words where they are the same."""
        return self.engine_remedy()

    def advise(self, remedy: str) -> CheckpointError:
        """Give the remedy of this occurrence, kept in every layer; returns self."""
        self.remedy = remedy
        return self

    def in_dagster_terms(self) -> CheckpointError:
        """Word the class's remedy for a Dagster user (for ``raise e.in_dagster_terms()``)."""
        self._dagster = True
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take facts, not a message: rebuild from the attributes, not from ``args``.
        return (_restore, (type(self), self.__dict__))


def _restore(cls: type[CheckpointError], state: dict[str, Any]) -> CheckpointError:
    error = cls.__new__(cls)
    Exception.__init__(error, state.get("what", ""))
    error.__dict__.update(state)
    return error
