"""The storage contract: the five operations behave the same on local disk, on S3 (moto), on GCS
(fake-gcs-server) and on Azure Blob (Azurite), and a scheme that cannot be used fails with an
error that says what to install.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

import pytest
from helpers.rows import Storage

from checkpoint_assets import StorageError
from checkpoint_assets.engine.storage import Store, open_store


@pytest.fixture(params=["local", "s3", "gcs", "azure"])
def storage(request: pytest.FixtureRequest, tmp_path: Any) -> Storage:
    """(base_dir, storage_options) of an empty checkpoint root on each backend."""
    if request.param == "local":
        return str(tmp_path / "checkpoints"), {}
    if request.param == "s3":
        return request.getfixturevalue("new_s3_storage")()  # type: ignore[no-any-return]
    server = request.getfixturevalue(f"{request.param}_server")
    return server.new_storage()  # type: ignore[no-any-return]


def _store(storage: Storage, *, own_client: bool = False) -> Store:
    """A store on the test's storage; ``own_client`` gives it its own S3 client and connections
    (fsspec otherwise shares one filesystem object between stores with the same options)."""
    base_dir, options = storage
    if own_client and options:
        options = {**options, "skip_instance_cache": True}
    return open_store(base_dir, options)


def test_put_then_get_returns_the_bytes_and_put_replaces_them_whole(storage: Storage) -> None:
    store = _store(storage)
    path = store.path("a", "b.bin")
    store.put(path, b"first version")
    store.put(path, b"second")

    assert store.get(path) == b"second"
    assert [f.name for f in store.list(store.path("a"))] == ["b.bin"]  # no temporary leftovers


def test_a_missing_file_reads_as_absent_not_as_an_error(storage: Storage) -> None:
    store = _store(storage)

    with pytest.raises(FileNotFoundError):
        store.get(store.path("never-written"))
    assert store.get_or_none(store.path("never-written")) is None
    assert store.list(store.path("no-such-folder")) == []
    assert store.list_recursive(store.path("no-such-folder")) == []


def test_put_if_absent_creates_once_and_never_overwrites(storage: Storage) -> None:
    store = _store(storage)
    path = store.path("x.lock")

    assert store.put_if_absent(path, b"mine") is True
    assert store.put_if_absent(path, b"theirs") is False
    assert store.get(path) == b"mine"


def test_writers_racing_to_create_the_same_file_have_exactly_one_winner(storage: Storage) -> None:
    writers = [_store(storage, own_client=True) for _ in range(6)]
    for round_ in range(5):
        path = writers[0].path(f"race-{round_}.lock")
        start = threading.Barrier(len(writers))
        won: list[bytes] = []

        def race(
            store: Store, me: bytes, path: str = path, start: Any = start, won: Any = won
        ) -> None:
            start.wait()
            if store.put_if_absent(path, me):
                won.append(me)

        threads = [
            threading.Thread(target=race, args=(s, f"writer {i}".encode()))
            for i, s in enumerate(writers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        assert len(won) == 1
        assert writers[0].get(path) == won[0]


def test_list_gives_direct_files_with_sizes_and_list_recursive_every_file(
    storage: Storage,
) -> None:
    store = _store(storage)
    store.put(store.path("cp", "one.parquet"), b"12345")
    store.put(store.path("cp", "one.parquet.parts", "part-1.parquet"), b"123")
    store.put(store.path("cp", "deeper", "two", "x.json"), b"{}")

    direct = {f.name: f.size for f in store.list(store.path("cp"))}
    every = sorted(f.path for f in store.list_recursive(store.path("cp")))

    assert direct == {"one.parquet": 5}
    assert every == sorted(
        [
            store.path("cp", "one.parquet"),
            store.path("cp", "one.parquet.parts", "part-1.parquet"),
            store.path("cp", "deeper", "two", "x.json"),
        ]
    )
    assert all(f.mtime is not None for f in store.list(store.path("cp")))


def test_delete_removes_files_and_ignores_those_already_gone(storage: Storage) -> None:
    store = _store(storage)
    keep, drop = store.path("d", "keep"), store.path("d", "drop")
    store.put(keep, b"k")
    store.put(drop, b"d")

    store.delete([drop, store.path("d", "never-existed")])
    store.delete([drop])

    assert [f.name for f in store.list(store.path("d"))] == ["keep"]


def test_a_file_written_by_another_client_is_listed_at_once(storage: Storage) -> None:
    """Listing caches are off: a resume sees every part the previous run committed."""
    reader, writer = _store(storage, own_client=True), _store(storage, own_client=True)
    folder = reader.path("cp.parquet.parts")
    writer.put(reader.path("cp.parquet.parts", "part-1.parquet"), b"1")
    assert len(reader.list(folder)) == 1  # a cache, if any, now holds this listing

    writer.put(reader.path("cp.parquet.parts", "part-2.parquet"), b"2")
    writer.delete([reader.path("cp.parquet.parts", "part-1.parquet")])

    assert [f.name for f in reader.list(folder)] == ["part-2.parquet"]
    assert [f.name for f in reader.list_recursive(folder)] == ["part-2.parquet"]


def test_each_operation_counts_its_requests(storage: Storage) -> None:
    store = _store(storage)
    store.put(store.path("f"), b"1")
    store.put_if_absent(store.path("g"), b"1")
    store.get(store.path("f"))
    store.list(store.path(""))
    store.delete([store.path("f")])

    assert store.requests == {"PUT": 2, "GET": 1, "LIST": 1, "DELETE": 1}


def test_display_gives_a_uri_the_user_can_paste(storage: Storage) -> None:
    base_dir, _ = storage
    store = _store(storage)

    assert store.display(store.path("a", "b.parquet")) == f"{base_dir.rstrip('/')}/a/b.parquet"


@pytest.mark.skipif(importlib.util.find_spec("ocifs") is not None, reason="ocifs is installed")
def test_a_scheme_without_its_package_names_the_package_to_install() -> None:
    with pytest.raises(StorageError, match=r"pip install ocifs"):
        open_store("oci://bucket/checkpoints")


def test_an_unknown_scheme_fails_clearly() -> None:
    with pytest.raises(StorageError, match=r"'nosuchfs://' is not available.*Check the scheme"):
        open_store("nosuchfs://bucket/checkpoints")
