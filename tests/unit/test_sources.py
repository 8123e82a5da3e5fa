"""Each blob's sources in the index (``store.sources``): written with the row, deleted with it,
loaded only for rows that exist; an index of schema 1 is marked for the one-time attribution.
Real LMDB in temp dirs."""

from __future__ import annotations

from pathlib import Path

import lmdb

from cachecd.store import sources
from cachecd.store.index import Entry, Index


def d(i: int) -> str:
    return f"{i:032x}"


def test_sources_go_with_their_row_and_only_theirs(tmp_path: Path) -> None:
    idx = Index(tmp_path / "ix")
    try:
        idx.put_entry(d(1), Entry(0, 10, 1.0), (d(0xA), sources.ORIGIN_SOURCE)).result()
        idx.put_entry(d(2), Entry(0, 10, 1.0), (d(0xB), sources.ORIGIN_SOURCE)).result()
        sources.put(idx, [(d(1), d(0xC), sources.ORIGIN_PEER)]).result()
        assert sources.load(idx, {d(1), d(2)}) == {d(1): {d(0xA), d(0xC)}, d(2): {d(0xB)}}
        idx.delete_entries([d(1)]).result()
        assert sources.load(idx, {d(1), d(2)}) == {d(2): {d(0xB)}}
        sources.put(idx, [(d(3), d(0xD), sources.ORIGIN_SOURCE)]).result()  # a row raced away
        assert sources.load(idx, idx.load_entries()) == {d(2): {d(0xB)}}
    finally:
        idx.close()


def test_an_index_of_schema_1_with_rows_waits_for_attribution(tmp_path: Path) -> None:
    for rows in (0, 1):
        path = tmp_path / f"ix{rows}"
        idx = Index(path)
        if rows:
            idx.put_entries({d(1): Entry(0, 10, 1.0)}).result()
        idx.close()
        env = lmdb.open(str(path), max_dbs=8)
        with env.begin(write=True) as txn:
            txn.put(b"schema_version", b"1", db=env.open_db(b"meta", txn=txn))
        env.close()
        idx = Index(path)
        try:
            assert (idx.get_meta(sources.PENDING) is not None) == bool(rows)
            assert idx.get_meta(b"schema_version") == b"2"
        finally:
            idx.close()
