"""The batch function the component calls (``fn: dg_project.routing:route_batch``).

A stand-in for a model or API call: keyword rules, so the example runs offline.
"""

import polars as pl

RULES = {"refund": "billing", "invoice": "billing", "crash": "technical", "login": "account"}


def route_batch(batch: pl.DataFrame) -> pl.DataFrame:
    """The department of each ticket in ``batch`` (ticket_id, subject, body)."""
    text = pl.concat_str("subject", "body", separator=" ").str.to_lowercase()
    department = pl.lit("other")
    for keyword, name in reversed(RULES.items()):
        department = pl.when(text.str.contains(keyword)).then(pl.lit(name)).otherwise(department)
    return batch.select("ticket_id", department=department)
