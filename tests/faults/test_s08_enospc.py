"""Scenario 8: the cache dir's filesystem fills up (an 8 MiB tmpfs, budget set far larger). The
miss that cannot be written gets 507 disk_full, its temp is gone, the index is unchanged, cached
entries are still served, and once the filler is deleted the same fetch succeeds, no restart."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachecd.errors import DiskFull
from tests.faults.figures import FIGURES
from tests.faults.support import Model, fetch_verified, files_under, new_dir


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
        filler = tmpfs / "filler"
        FIGURES.set("s08.fs_bytes", 8 << 20)
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
        assert c.stats()["store"]["entries"] == 3
        FIGURES.set("s08.fetch_after_freeing_space", "ok, no restart")
    d.finish()


def test_lmdb_commit_failing_on_a_full_disk_leaves_the_index_unchanged(big: Model, tmpfs: Path, pool) -> None:  # type: ignore[no-untyped-def]
    """Leave room for the blob but not for new LMDB pages: the commit fails, the txn is aborted,
    and the blob already renamed into place is taken back. LMDB reuses freed pages when it can,
    so the exact free space that makes the commit (not the blob write) fail is searched for."""
    hub = pool.hub(big)
    d = pool.daemon(hub, [big], cache_dir=tmpfs / "cache", args=["--budget", "64MiB"])
    filler = tmpfs / "filler"
    entries = 0
    with d.client() as c:
        for layer, expert in [(lyr, e) for lyr in big.layers for e in range(4)]:
            entry = big.entry(layer, expert)
            blob = d.cache_dir / "blobs" / entry.digest_hex[:2] / entry.digest_hex
            for extra in range(0, 4 * 4096, 4096):
                _fill(filler)
                os.truncate(filler, max(0, filler.stat().st_size - entry.nbytes - extra))
                try:
                    fetch_verified(c, big, layer, [expert])
                    entries += 1
                    break
                except DiskFull:
                    assert c.stats()["store"]["entries"] == entries, "a failed write changed the index"
                    assert not blob.exists() and not files_under(d.cache_dir / "tmp")
                finally:
                    filler.unlink()
            if "event=index_commit_failed" in d.log():
                break
    failures = d.log().count("event=index_commit_failed")
    FIGURES.set("s08.lmdb_commit_failures_index_unchanged", failures)
    d.finish()
    if not failures:
        pytest.skip("LMDB reused freed pages for every commit: the disk never filled between "
                    "a blob and its row")
