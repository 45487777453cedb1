"""The ``checkpoint-assets`` console script (placeholder until the operator CLI lands)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    print("checkpoint-assets: operator commands (status, inspect, verify, compact) come next.")
    return 0
