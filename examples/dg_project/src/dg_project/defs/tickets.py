import dagster as dg
import polars as pl

SUBJECTS = ["Refund request", "App crash on start", "Cannot login", "Invoice copy", "Question"]


@dg.asset(group_name="support", kinds={"polars"})
def tickets() -> pl.DataFrame:
    """200 support tickets, generated: the rows the checkpointed asset routes."""
    ids = range(1, 201)
    return pl.DataFrame(
        {
            "ticket_id": list(ids),
            "subject": [SUBJECTS[i % len(SUBJECTS)] for i in ids],
            "body": [f"Ticket {i}: please help with my {SUBJECTS[i % 5].lower()}." for i in ids],
        }
    )
