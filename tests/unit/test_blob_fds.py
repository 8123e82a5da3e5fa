"""BlobFds, the daemon's LRU of open blob fds, over a real Store (real files, real LMDB)."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import xxhash

from cachecd import constants
from cachecd.store.blob_fds import BlobFds
from cachecd.store.store import Store


def _blob(i: int, size: int = 4096) -> tuple[str, bytes]:
    data = random.Random(i).randbytes(size)
    return xxhash.xxh3_128(data).hexdigest(), data


def _put(store: Store, i: int) -> tuple[str, bytes]:
    digest, data = _blob(i)
    store.commit_sync(digest, data, store.reserve_sync(len(data)))
    return digest, data


def _open_and_keep(store: Store, fds: BlobFds, digest: str) -> None:
    fd, size = store.open_blob(digest)
    fds.keep(digest, fd, size)
    os.close(fd)


def _read(fd: int, size: int) -> bytes:
    try:
        return os.pread(fd, size + 1, 0)
    finally:
        os.close(fd)


def _held(store: Store) -> int:
    """Open fds of this process on files under the store's blob dirs (linked or not)."""
    root = str(store.blobs.dirs[0].blobs)
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(root)
        except OSError:
            pass
    return n


def test_a_kept_fd_is_handed_out_as_a_dup_with_the_right_bytes(tmp_path: Path) -> None:
    async def body() -> None:
        store = Store.open_sync([tmp_path / "c"])
        fds = BlobFds(store)
        try:
            digest, data = _put(store, 1)
            assert fds.take(digest) is None  # nothing kept yet
            _open_and_keep(store, fds, digest)
            assert len(fds) == 1 and _held(store) == 1
            fd, size = fds.take(digest)  # type: ignore[misc]
            assert size == len(data) and _read(fd, size) == data
            fd, size = fds.take(digest)  # type: ignore[misc]
            assert _read(fd, size) == data  # still kept: the caller closed only its dup
            assert _held(store) == 1
        finally:
            fds.clear()
            store.close_sync()
        assert _held(store) == 0

    asyncio.run(body())


def test_evicted_quarantined_unlinked_or_truncated_blobs_are_not_handed_out(tmp_path: Path) -> None:
    async def body() -> None:
        store = Store.open_sync([tmp_path / "c"])
        fds = BlobFds(store)
        try:
            blobs = [_put(store, i) for i in range(4)]
            for digest, _ in blobs:
                _open_and_keep(store, fds, digest)
            (evicted, _), (rotten, _), (gone, _), (short, _) = blobs
            assert store.evict_sync([evicted]) > 0
            await store.quarantine(rotten)
            os.unlink(store.blobs.path(0, gone))
            os.truncate(store.blobs.path(0, short), 10)
            for digest, _ in blobs:
                assert fds.take(digest) is None, digest
            assert len(fds) == 0 and _held(store) == 0  # refused ones are closed at once
            digest, data = _put(store, 0)  # the evicted blob comes back: a new row, a new file
            assert digest == evicted and fds.take(digest) is None
            _open_and_keep(store, fds, digest)
            fd, size = fds.take(digest)  # type: ignore[misc]
            assert _read(fd, size) == data
        finally:
            fds.clear()
            store.close_sync()

    asyncio.run(body())


def test_check_closes_fds_of_evicted_blobs_without_waiting_for_a_hit(tmp_path: Path) -> None:
    async def body() -> None:
        store = Store.open_sync([tmp_path / "c"])
        fds = BlobFds(store)
        try:
            blobs = [_put(store, i) for i in range(3)]
            for digest, _ in blobs:
                _open_and_keep(store, fds, digest)
            fds.check()
            assert len(fds) == 3  # no eviction since: nothing closed
            store.evict_sync([blobs[0][0], blobs[1][0]])
            fds.check()  # the evicted files' space must not stay pinned by our fds
            assert len(fds) == 1 and _held(store) == 1
        finally:
            fds.clear()
            store.close_sync()

    asyncio.run(body())


def test_lru_capacity_and_idle_close(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(constants, "BLOB_FDS_IDLE_S", 0.05)
    monkeypatch.setattr(constants, "BLOB_FDS_SWEEP_S", 0.02)

    async def body() -> None:
        store = Store.open_sync([tmp_path / "c"])
        fds = BlobFds(store, capacity=2)
        try:
            blobs = [_put(store, i) for i in range(3)]
            for digest, _ in blobs:
                _open_and_keep(store, fds, digest)
            assert len(fds) == 2 and fds.take(blobs[0][0]) is None  # the oldest went first
            for _ in range(100):  # idle: the timer closes everything
                if not len(fds):
                    break
                await asyncio.sleep(0.02)
            assert len(fds) == 0 and _held(store) == 0
        finally:
            fds.clear()
            store.close_sync()

    asyncio.run(body())
