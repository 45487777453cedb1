"""Following an asset's event records with a cursor, as the sensors do."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import dagster as dg

PAGE = 1000  # records per query

Fetch = Callable[..., dg.EventRecordsResult]


def records_after(fetch: Fetch, key: dg.AssetKey, after: int) -> Iterator[dg.EventLogRecord]:
    """Every record of ``key`` after the storage id ``after`` (0: from the first), oldest first,
    a page at a time. ``fetch``: ``instance.fetch_materializations`` or
    ``instance.fetch_observations``."""
    cursor: str | None = None
    while True:
        result = fetch(
            dg.AssetRecordsFilter(asset_key=key, after_storage_id=after or None),
            limit=PAGE,
            cursor=cursor,
            ascending=True,
        )
        yield from result.records
        if not result.has_more:
            return
        cursor = result.cursor
