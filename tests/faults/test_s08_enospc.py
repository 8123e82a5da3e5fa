"""Scenario 8: the cache dir's filesystem fills up (an 8 MiB tmpfs, budget set far larger). The
miss that cannot be written gets 507 disk_full, its temp is gone, the index is unchanged, cached
entries are still served, and once the filler is deleted the same fetch succeeds, no restart.
The disk also fills at the named crash point between a blob's rename and its row's commit, so
that the LMDB commit is what fails, every run."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from cachecd.errors import DiskFull
from cachecd.store.index import INDEX_DIRNAME
from tests.faults.figures import FIGURES
from tests.faults.support import Model, fetch_verified, files_under, new_dir

PAUSE_S = 6.0  # at before_index_commit: the time the test has to fill the disk
REGISTRATIONS = 8  # daemon writes that use up the pages free before the pinned read


@pytest.fixture
def tmpfs() -> Iterator[Path]:
    root = new_dir("cdfs")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(root)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        os.rmdir(root)
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    yield root
    subprocess.run(["umount", "-l", str(root)], check=False)
    os.rmdir(root)


def _fill(path: Path) -> int:
    """Write until the filesystem says ENOSPC; returns bytes written."""
    written, chunk = 0, b"\0" * (256 << 10)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n = f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                if len(chunk) <= 4096:
                    return written
                chunk = chunk[: len(chunk) // 4]
                continue
            written += n or 0


def test_disk_full_507_then_a_fetch_succeeds_after_space_is_freed(big: Model, tmpfs: Path, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(big)
    d = pool.daemon(hub, [big], cache_dir=tmpfs / "cache", args=["--budget", "64MiB"])
    layer = big.layers[0]
    with d.client() as c:
        fetch_verified(c, big, layer, [0, 1])
        pid = c.health()["pid"]
        # A miss is answered before its commit; status waits for commits under way, so the disk
        # is filled after both blobs are durable (a commit failing on the full disk would take
        # its blob back and free the room the next fetch is meant not to find).
        assert c.stats()["store"]["entries"] == 2
        filler = tmpfs / "filler"
        st = os.statvfs(tmpfs)
        FIGURES.set("s08.fs_bytes", st.f_blocks * st.f_frsize)
        FIGURES.set("s08.filler_bytes", _fill(filler))
        with pytest.raises(DiskFull) as info:
            fetch_verified(c, big, layer, [2])
        assert info.value.retryable and info.value.http_status == 507
        FIGURES.set("s08.error", f"{info.value.http_status} {info.value.code}")
        assert not files_under(d.cache_dir / "tmp"), "the failed write left its temp"
        assert c.stats()["store"]["entries"] == 2
        fetch_verified(c, big, layer, [0, 1])  # what is cached is still served
        filler.unlink()
        fetch_verified(c, big, layer, [2])  # room again: no restart needed
        after = c.stats()
        assert after["store"]["entries"] == 3 and after["pid"] == pid
        FIGURES.set("s08.entries_after_freeing_space", after["store"]["entries"])
        FIGURES.set("s08.daemon_restarts_to_recover", int(after["pid"] != pid))
    d.finish()


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _wait_for(what: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_lmdb_commit_failing_on_a_full_disk_leaves_the_index_unchanged(big: Model, tmpfs: Path, pool) -> None:  # type: ignore[no-untyped-def]
    """The daemon pauses at the named crash point ``before_index_commit``: the blob is written,
    fsynced and renamed into place, its row not committed yet. The disk fills then, so the row's
    commit is what fails: the txn is aborted, the index unchanged, the blob taken back.

    LMDB reuses pages that older txns freed, so a full disk alone does not always fail a small
    commit. A read txn pinned to the present keeps every page freed from now on, and a few
    writes by the daemon (registrations) use up what was free before: from then on a commit
    must grow the file, which a full disk refuses."""
    hub = pool.hub(big)
    d = pool.daemon(hub, [big], cache_dir=tmpfs / "cache", args=["--budget", "64MiB"],
                    env={"CACHECD_PAUSE_AT": f"before_index_commit:{PAUSE_S}"})
    layer, expert = big.layers[1], 3
    entry = big.entry(layer, expert)
    blob = d.cache_dir / "blobs" / entry.digest_hex[:2] / entry.digest_hex
    filler = tmpfs / "filler"
    env = lmdb.open(str(d.cache_dir / INDEX_DIRNAME), readonly=True, max_dbs=8)
    try:
        with d.client() as c:
            fetch_verified(c, big, layer, [expert])  # answered from its temp; the commit pauses
            _wait_for(blob.exists)  # renamed into place: the pause before the row has begun
            paused = time.monotonic()
            with env.begin() as pinned:
                first = env.info()["last_txnid"]
                for _ in range(REGISTRATIONS):
                    c.register(big.manifest_path)
                _wait_for(lambda: env.info()["last_txnid"] >= first + REGISTRATIONS)
                FIGURES.set("s08.filler_bytes_for_the_commit", _fill(filler))
                FIGURES.set("s08.free_bytes_at_the_commit", _free_bytes(tmpfs))
                assert time.monotonic() - paused < PAUSE_S, "the disk filled after the pause ended"
                _wait_for(lambda: f"event=commit_failed digest={entry.digest_hex}" in d.log(),
                          PAUSE_S + 30)
                assert pinned.id() == first
            log = d.log()
            assert "event=index_commit_failed" in log  # the row's commit, after the blob's write
            stats = c.stats()["store"]
            assert stats["entries"] == 0, "a failed commit changed the index"
            assert not blob.exists() and not files_under(d.cache_dir / "tmp")
            filler.unlink()
            fetch_verified(c, big, layer, [expert])  # room again: committed this time
            assert c.stats()["store"]["entries"] == 1
    finally:
        env.close()
    failed = log.count(f"event=commit_failed digest={entry.digest_hex}")
    FIGURES.set("s08.lmdb_commit_failures_index_unchanged", failed)
    FIGURES.set("s08.entries_after_the_failed_commit", stats["entries"])
    d.finish()
