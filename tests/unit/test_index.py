"""The LMDB index: real LMDB in temp dirs."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lmdb
import pytest

from cachecd import constants, errors
from cachecd.store import index as index_mod
from cachecd.store.index import Entry, Index


def digest(i: int) -> str:
    return f"{i:032x}"


def fill(idx: Index, start: int, n: int, batch: int = 250) -> None:
    for lo in range(start, start + n, batch):
        rows = {digest(i): Entry(i % 3, i, 1.5) for i in range(lo, min(lo + batch, start + n))}
        idx.put_entries(rows).result(timeout=60)  # a starved writer fails, not hangs


def test_entries_pins_models_meta_round_trip(tmp_path: Path) -> None:
    idx = Index(tmp_path / "ix")
    idx.put_entry(digest(1), Entry(0, 100, 2.0)).result()
    idx.put_entry(digest(2), Entry(1, 200, 3.0)).result()
    idx.delete_entries([digest(1)]).result()
    idx.set_pin(digest(7), True).result()
    idx.put_model("org/m@x", {"repo": "org/m"}).result()
    idx.put_meta(b"k", b"v").result()
    idx.close()
    again = Index(tmp_path / "ix")
    assert again.load_entries() == {digest(2): Entry(1, 200, 3.0)}
    assert again.load_pins() == {digest(7)}
    assert again.load_models() == {"org/m@x": {"repo": "org/m"}}
    assert again.get_meta(b"k") == b"v"
    assert again.get_meta(b"schema_version") == str(constants.INDEX_SCHEMA_VERSION).encode()
    again.close()


def test_map_full_grows_to_hold_10k_rows(tmp_path: Path) -> None:
    idx = Index(tmp_path / "ix", map_size=64 * 1024)
    fill(idx, 0, 10_000)
    assert idx.env.info()["map_size"] > 64 * 1024
    assert len(idx.load_entries()) == 10_000
    idx.close()
    again = Index(tmp_path / "ix", map_size=64 * 1024)
    assert len(again.load_entries()) == 10_000
    again.close()


def test_map_ceiling_raises_index_full_and_leaves_index_unchanged(tmp_path: Path) -> None:
    idx = Index(tmp_path / "ix", map_size=64 * 1024, map_ceiling=128 * 1024)
    with pytest.raises(errors.IndexFull) as info:
        fill(idx, 0, 10_000)
    assert info.value.http_status == 507 and info.value.retryable
    before = len(idx.load_entries())
    assert 0 < before < 10_000 and before % 250 == 0  # whole batches only
    with pytest.raises(errors.IndexFull):
        fill(idx, 20_000, 2000, batch=2000)
    assert len(idx.load_entries()) == before
    idx.delete_entries([digest(i) for i in range(before // 2)]).result()
    fill(idx, 30_000, 100)  # room again after deletes
    idx.close()


def test_other_lmdb_error_is_disk_full_and_aborts(tmp_path: Path) -> None:
    idx = Index(tmp_path / "ix")

    def op(txn: lmdb.Transaction) -> None:
        txn.put(bytes.fromhex(digest(5)), b"x" * 18, db=idx.entries)
        raise lmdb.Error("mdb_txn_commit: Input/output error")

    with pytest.raises(errors.DiskFull, match="unchanged"):
        idx.submit(op).result()
    assert idx.load_entries() == {}
    idx.put_entry(digest(6), Entry(0, 1, 0.0)).result()  # the writer survives
    idx.close()


def test_readers_run_while_the_map_grows(tmp_path: Path) -> None:
    idx = Index(tmp_path / "ix", map_size=64 * 1024)
    stop = threading.Event()
    failures: list[BaseException] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                idx.load_entries()
                idx.access_counts("m")
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)
                return

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    fill(idx, 0, 3000, batch=100)
    stop.set()
    for t in threads:
        t.join()
    assert failures == []
    assert idx.env.info()["map_size"] > 64 * 1024
    idx.close()


def test_access_counts_batched_and_flushed(tmp_path: Path) -> None:
    idx = Index(tmp_path / "ix", flush_every=10_000, flush_interval=3600)
    for _ in range(3):
        idx.record_access(digest(1), "org/m@r", 2, 5, 10.0)
    idx.record_access(digest(2), "org/m@r", 2, 6, 11.0)
    idx.record_access(digest(3), None, -1, -1, 12.0)
    with idx.read() as txn:
        assert txn.stat(idx.access)["entries"] == 0  # nothing written yet: batched
    assert idx.access_counts("org/m@r") == {(2, 5): (3, 10.0), (2, 6): (1, 11.0)}
    idx.flush_access()
    idx.record_access(digest(1), "org/m@r", 2, 5, 20.0)
    assert idx.access_counts("org/m@r")[(2, 5)] == (4, 20.0)  # stored + pending
    idx.close()  # flushes
    again = Index(tmp_path / "ix")
    assert again.access_counts("org/m@r") == {(2, 5): (4, 20.0), (2, 6): (1, 11.0)}
    assert again.access_counts("org/m") == {}  # a prefix of another key is not a match
    assert again.load_digest_access()[digest(3)] == (1, 12.0)
    again.close()


def test_access_flushes_by_count(tmp_path: Path) -> None:
    idx = Index(tmp_path / "ix", flush_every=5, flush_interval=3600)
    for i in range(6):
        idx.record_access(digest(i), None, -1, -1, 1.0)
    idx.submit(lambda txn: None).result()  # the writer checks the count after each job
    with idx.read() as txn:
        assert txn.stat(idx.access)["entries"] == 6
    idx.close()


def test_schema_migration_and_newer_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Index(tmp_path / "ix").close()
    calls: list[int] = []
    monkeypatch.setattr(constants, "INDEX_SCHEMA_VERSION", constants.INDEX_SCHEMA_VERSION + 1)
    monkeypatch.setitem(
        index_mod.MIGRATIONS, constants.INDEX_SCHEMA_VERSION - 1, lambda txn, ix: calls.append(1)
    )
    Index(tmp_path / "ix").close()
    Index(tmp_path / "ix").close()
    assert calls == [1]
    monkeypatch.setattr(constants, "INDEX_SCHEMA_VERSION", constants.INDEX_SCHEMA_VERSION - 1)
    with pytest.raises(errors.Internal, match="newer"):
        Index(tmp_path / "ix")


_GROWER = """
import sys, time
from pathlib import Path
from cachecd.store.index import Entry, Index
idx = Index(Path(sys.argv[1]), map_size=64 * 1024)
i = 0
while True:
    idx.put_entries({f"{j:032x}": Entry(0, j, 0.0) for j in range(i, i + 50)}).result()
    i += 50
    print(idx.env.info()["map_size"], i, flush=True)
"""


def test_kill_during_growth_reopens_cleanly(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _GROWER, str(tmp_path / "ix")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    committed = 0
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        size, committed = map(int, line.split())
        if size >= 4 * 64 * 1024 or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    idx = Index(tmp_path / "ix", map_size=64 * 1024)
    rows = idx.load_entries()
    assert len(rows) >= committed and len(rows) % 50 == 0
    fill(idx, 1_000_000, 500)
    idx.close()


def _queued_behind_a_gate(idx: Index, jobs: list) -> list:  # type: ignore[type-arg]
    """Submit jobs while the writer is held, so they queue up and drain as one batch."""
    gate = threading.Event()
    blocker = idx.submit(lambda txn: gate.wait(10))
    futures = [idx.submit(job) for job in jobs]
    gate.set()
    blocker.result()
    return futures


def _put(i: int, idx: Index):  # type: ignore[no-untyped-def]
    return lambda txn: txn.put(bytes.fromhex(digest(i)), b"\0" * 18, db=idx.entries) and None


def test_queued_writes_share_one_txn(tmp_path: Path) -> None:
    idx = Index(tmp_path / "ix")
    before = idx.env.info()["last_txnid"]
    for fut in _queued_behind_a_gate(idx, [_put(i, idx) for i in range(8)]):
        fut.result()
    assert idx.env.info()["last_txnid"] == before + 1  # 8 jobs, one commit
    assert len(idx.load_entries()) == 8
    idx.close()


def test_a_bad_job_in_a_batch_fails_alone(tmp_path: Path) -> None:
    idx = Index(tmp_path / "ix")

    def bad(txn: lmdb.Transaction) -> None:
        txn.put(bytes.fromhex(digest(99)), b"x" * 18, db=idx.entries)
        raise lmdb.Error("mdb_txn_commit: Input/output error")

    jobs = [_put(i, idx) for i in range(4)] + [bad] + [_put(i, idx) for i in range(4, 8)]
    futures = _queued_behind_a_gate(idx, jobs)
    with pytest.raises(errors.DiskFull):
        futures[4].result()
    for fut in futures[:4] + futures[5:]:
        fut.result()
    assert sorted(idx.load_entries()) == [digest(i) for i in range(8)]
    idx.close()
