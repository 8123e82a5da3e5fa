"""Store: real temp dirs, real LMDB, real files."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import pytest
import xxhash

from cachecd import errors
from cachecd.store.crash import WRITE_PATH_POINTS
from cachecd.store.fsck import fsck
from cachecd.store.store import Store


def blob(i: int, size: int = 1024) -> tuple[str, bytes]:
    data = random.Random(i).randbytes(size)
    return xxhash.xxh3_128(data).hexdigest(), data


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def put(store: Store, i: int, size: int = 1024) -> str:
    digest, data = blob(i, size)
    res = await store.reserve(len(data))
    await store.commit(digest, data, res)
    return digest


def read_all(store: Store, digest: str) -> bytes:
    fd, size = store.open_blob(digest)
    try:
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "blobs").rglob("*") if p.is_file())


def test_round_trip_and_reopen(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path])
        digests = [await put(store, i, 1000 + i) for i in range(5)]
        for i, d in enumerate(digests):
            assert store.has(d) and store.size_of(d) == 1000 + i
            assert read_all(store, d) == blob(i, 1000 + i)[1]
        assert store.stats()["entries"] == 5 and store.stats()["bytes"] == sum(
            1000 + i for i in range(5)
        )
        await store.close()
        again = await Store.open([tmp_path])
        assert sorted(again.digests()) == sorted(digests)
        assert read_all(again, digests[3]) == blob(3, 1003)[1]
        assert again.recovery.rows_dropped == 0 and again.recovery.strays_adopted == 0
        await again.close()

    run(go())
    assert fsck([tmp_path]).exit_code == 0


def test_a_dropped_store_is_freed_without_the_collector(tmp_path: Path) -> None:
    """No reference cycle keeps a store alive: its entries and policy (~10^5 objects at K3
    scale) go with its last reference, not at a later pass of the collector (a later open's)."""
    store = Store.open_sync([tmp_path])
    digest, data = blob(0)
    store.commit_sync(digest, data, store.reserve_sync(len(data)))
    store.close_sync()
    gone = weakref.ref(store)
    was = gc.isenabled()
    gc.disable()
    try:
        del store
        assert gone() is None
    finally:
        if was:
            gc.enable()


def test_second_open_is_locked(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path])
        with pytest.raises(errors.CacheLocked, match=f"pid {os.getpid()}"):
            await Store.open([tmp_path])
        await store.close()
        (await Store.open([tmp_path])).close_sync()  # released on close

    run(go())


def test_invalid_digest_rejected_before_io(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path])
        for bad in ("../../etc/passwd", "A" * 32, "0" * 31, "0" * 33, "", "0" * 31 + "/"):
            with pytest.raises(errors.InvalidRequest):
                store.open_blob(bad)
            with pytest.raises(errors.InvalidRequest):
                store.has(bad)
        res = await store.reserve(10)
        with pytest.raises(errors.InvalidRequest):
            await store.commit("../x" + "0" * 28, b"x" * 10, res)
        assert store.stats()["reserved"] == 0
        await store.close()

    run(go())


def test_commit_rejects_more_than_reserved_and_releases(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path], budget=10_000)
        digest, data = blob(1, 2000)
        res = await store.reserve(1000)
        with pytest.raises(errors.InvalidRequest):
            await store.commit(digest, data, res)
        assert store.stats()["reserved"] == 0 and not store.has(digest)
        assert list((tmp_path / "tmp").iterdir()) == []
        await store.close()

    run(go())


def test_budget_zipf_never_exceeded_and_hot_set_kept(tmp_path: Path) -> None:
    budget = 16 * 1024
    rng = random.Random(7)
    weights = [1 / (r + 1) ** 1.2 for r in range(40)]
    trace = rng.choices(range(40), weights=weights, k=300)

    async def go(policy: str, root: Path) -> None:
        store = await Store.open([root], budget=budget, policy=policy)
        for i in trace:
            digest = blob(i)[0]
            if store.has(digest):
                store.touch(digest)
            else:
                await put(store, i)
                store.touch(digest)
            st = store.stats()
            assert st["bytes"] + st["reserved"] <= budget
            assert disk_bytes(root) <= budget
        for hot in range(3):
            assert store.has(blob(hot)[0]), f"{policy} lost hot expert {hot}"
        await store.close()

    for policy in ("lru", "default"):
        root = tmp_path / policy
        run(go(policy, root))


def test_too_large_and_reservations_full(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path], budget=4096)
        with pytest.raises(errors.TooLarge) as info:
            await store.reserve(4097)
        assert info.value.http_status == 400 and not info.value.retryable
        r1 = await store.reserve(3000)
        with pytest.raises(errors.ReservationsFull) as full:
            await store.reserve(2000)
        assert full.value.retryable and full.value.http_status == 507
        r1.release()
        async with await store.reserve(4096) as r2:
            assert store.stats()["reserved"] == 4096
        assert r2.done and store.stats()["reserved"] == 0
        await store.close()

    run(go())


def test_pins_never_evicted(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path], budget=4 * 1024, policy="lru")
        pinned = [await put(store, i) for i in range(3)]
        for d in pinned:
            await store.pin(d)
        for i in range(3, 20):
            await put(store, i)
        assert all(store.has(d) for d in pinned)
        with pytest.raises(errors.ReservationsFull):
            await store.reserve(2048)  # only one unpinned KiB could go
        assert await store.evict(pinned) == 0
        await store.unpin(pinned[0])
        assert await store.evict([pinned[0]]) == 1024
        await store.close()
        again = await Store.open([tmp_path], budget=4 * 1024)
        assert again.pins() == set(pinned[1:])
        await again.close()

    run(go())


def test_restart_with_smaller_budget_evicts_first(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path])
        for i in range(10):
            await put(store, i)
        await store.close()
        small = await Store.open([tmp_path], budget=4 * 1024)
        assert small.stats()["bytes"] <= 4 * 1024 and small.recovery.evicted == 6
        assert disk_bytes(tmp_path) <= 4 * 1024
        await small.close()

    run(go())


def test_eviction_does_not_cut_a_read_short(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path], budget=64 * 1024)
        digest = await put(store, 1, 64 * 1024)
        fd, size = store.open_blob(digest)
        try:
            assert await store.evict([digest]) == size
            assert not store.has(digest) and not store.blobs.path(0, digest).exists()
            assert os.pread(fd, size, 0) == blob(1, 64 * 1024)[1]
        finally:
            os.close(fd)
        await store.close()

    run(go())


def test_missing_and_short_blob_on_open_drop_the_row(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path])
        gone, short, link = await put(store, 1), await put(store, 2), await put(store, 3)
        store.blobs.path(0, gone).unlink()
        os.truncate(store.blobs.path(0, short), 10)
        os.rename(store.blobs.path(0, link), tmp_path / "outside")
        store.blobs.path(0, link).symlink_to(tmp_path / "outside")
        for d in (gone, short, link):
            with pytest.raises(errors.ExpertNotFound):
                store.open_blob(d)
            assert not store.has(d)
        assert len(list((tmp_path / "quarantine").iterdir())) == 2
        assert store.stats()["bytes"] == 0
        await put(store, 1)  # a refetch works
        await store.close()
        again = await Store.open([tmp_path])
        assert again.digests() == [gone]
        await again.close()

    run(go())


def test_quarantine_moves_file_and_drops_row(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path])
        digest = await put(store, 1)
        await store.quarantine(digest)
        assert not store.has(digest) and not store.blobs.path(0, digest).exists()
        assert [p.name.split(".")[0] for p in (tmp_path / "quarantine").iterdir()] == [digest]
        await store.close()

    run(go())


def test_models_and_access_counts_persist(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path])
        digest = await put(store, 1)
        store.put_model("org/m@" + "a" * 40, {"repo": "org/m", "revision": "a" * 40})
        for _ in range(3):
            store.touch(digest, "org/m@" + "a" * 40, 4, 17)
        store.touch(blob(9)[0], "org/m@" + "a" * 40, 4, 18)  # a miss counts for coverage too
        assert store.access_counts("org/m@" + "a" * 40)[(4, 17)][0] == 3
        assert store.stats()["uses_cached"] == 3 and store.stats()["uses_gone"] == 1
        await store.close()
        again = await Store.open([tmp_path])
        counts = again.access_counts("org/m@" + "a" * 40)
        assert {k: v[0] for k, v in counts.items()} == {(4, 17): 3, (4, 18): 1}
        assert again.access_counts("org/other@" + "a" * 40) == {}
        assert again.models() == [
            {"repo": "org/m", "revision": "a" * 40, "key": "org/m@" + "a" * 40}
        ]
        assert again.get_model("org/m@" + "a" * 40) == {"repo": "org/m", "revision": "a" * 40}
        await again.close()

    run(go())


def test_two_dirs_spread_and_recover(tmp_path: Path) -> None:
    dirs = [tmp_path / "ssd0", tmp_path / "ssd1"]

    async def go() -> None:
        store = await Store.open(dirs)
        digests = [await put(store, i) for i in range(30)]
        used = {store.ledger.entries[d].dir_index for d in digests}
        assert used == {0, 1}
        await store.close()
        again = await Store.open(dirs)
        assert all(read_all(again, d) == blob(i)[1] for i, d in enumerate(digests))
        await again.close()

    run(go())


def test_concurrent_commits_respect_budget(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path], budget=8 * 1024)
        full = 0

        async def put_retrying(i: int) -> None:
            nonlocal full
            while True:
                try:
                    await put(store, i)
                    return
                except errors.ReservationsFull:  # all 8 slots are being written: retry
                    full += 1
                    await asyncio.sleep(0.005)

        await asyncio.gather(*(put_retrying(i) for i in range(40)))
        assert full > 0  # the budget really was the limit
        st = store.stats()
        assert st["bytes"] <= 8 * 1024 and st["reserved"] == 0 and st["entries"] == 8
        assert disk_bytes(tmp_path) == st["bytes"]
        await store.close()

    run(go())


_CHILD = """
import asyncio, random, sys
from pathlib import Path
from cachecd.store.store import Store
async def main():
    store = await Store.open([Path(sys.argv[1])])
    data = random.Random(int(sys.argv[3])).randbytes(int(sys.argv[4]))
    res = await store.reserve(len(data))
    await store.commit(sys.argv[2], data, res)
    await store.close()
asyncio.run(main())
"""


@pytest.mark.parametrize("point", WRITE_PATH_POINTS)
def test_crash_points(tmp_path: Path, point: str) -> None:
    async def seed() -> str:
        store = await Store.open([tmp_path])
        d = await put(store, 100)
        await store.close()
        return d

    seeded = run(seed())
    digest, data = blob(1, 64 * 1024)
    env = {**os.environ, "CACHECD_CRASH_AT": point}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), digest, "1", str(len(data))],
        env=env, capture_output=True, timeout=60, check=False,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]

    async def check() -> None:
        store = await Store.open([tmp_path])
        assert list((tmp_path / "tmp").iterdir()) == []
        expect_present = point not in ("after_tmp_write", "after_fsync")
        assert store.has(digest) == expect_present
        if expect_present:
            assert read_all(store, digest) == data
        else:
            assert not store.blobs.path(0, digest).exists()
        assert read_all(store, seeded) == blob(100)[1]
        await store.close()

    run(check())
    assert fsck([tmp_path]).exit_code == 0


def test_index_map_growth_through_store(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path], map_size=64 * 1024)
        await asyncio.gather(*(put(store, i, 16) for i in range(300)))
        assert store.stats()["index_map_size"] > 64 * 1024
        await store.close()
        again = await Store.open([tmp_path], map_size=64 * 1024)
        assert again.stats()["entries"] == 300
        await again.close()

    run(go())


def test_index_full_at_ceiling_evicts_and_keeps_serving(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path], map_size=64 * 1024, map_ceiling=64 * 1024)
        for i in range(900):
            await put(store, i, 16)
        st = store.stats()
        assert st["evictions"] > 0 and st["entries"] + st["evictions"] == 900
        assert store.has(blob(899, 16)[0])
        await store.close()

    run(go())
    assert fsck([tmp_path]).exit_code == 0


def _mount_tmpfs(size: str) -> Path:
    mnt = Path(tempfile.mkdtemp(prefix="cdfs", dir="/tmp"))
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    return mnt


def _umount(mnt: Path) -> None:
    subprocess.run(["umount", str(mnt)], check=False)
    mnt.rmdir()


def test_disk_full_on_small_tmpfs() -> None:
    mnt = _mount_tmpfs("8m")
    try:
        run(_disk_full_scenario(mnt))
        assert fsck([mnt]).exit_code == 0
    finally:
        _umount(mnt)


async def _disk_full_scenario(mnt: Path) -> None:
    store = await Store.open([mnt], budget=64 * 1024 * 1024)
    kept: list[str] = []
    with pytest.raises(errors.DiskFull) as info:
        for i in range(20):
            kept.append(await put(store, i, 1024 * 1024))
    assert info.value.http_status == 507 and info.value.retryable
    assert len(kept) >= 3
    assert list((mnt / "tmp").iterdir()) == []
    assert store.stats()["reserved"] == 0
    for i, d in enumerate(kept):
        assert read_all(store, d) == blob(i, 1024 * 1024)[1]
    assert await store.evict(kept[:2]) == 2 * 1024 * 1024
    late = await put(store, 99, 1024 * 1024)
    assert read_all(store, late) == blob(99, 1024 * 1024)[1]
    await store.close()


def test_disk_full_with_a_filler_then_recovers() -> None:
    """Fill the fs so small blobs and the LMDB commit itself hit ENOSPC; the index stays sane."""
    mnt = _mount_tmpfs("4m")
    try:
        run(_filler_scenario(mnt))
        assert fsck([mnt]).exit_code == 0
    finally:
        _umount(mnt)


def _fill_file(path: Path) -> None:
    with open(path, "wb") as f:
        while True:
            f.write(b"\0" * 65536)
            f.flush()


async def _filler_scenario(mnt: Path) -> None:
    store = await Store.open([mnt], budget=1 << 40)
    before = await put(store, 1, 4096)
    filler = mnt / "filler"
    with pytest.raises(OSError):
        _fill_file(filler)
    failures = 0
    for i in range(2, 40):
        try:
            await put(store, i, 512)
        except errors.DiskFull:
            failures += 1
    assert failures > 0
    assert list((mnt / "tmp").iterdir()) == []
    entries = store.stats()["entries"]
    await store.close()
    again = await Store.open([mnt], budget=1 << 40)
    assert again.stats()["entries"] == entries and again.recovery.rows_dropped == 0
    assert read_all(again, before) == blob(1, 4096)[1]
    filler.unlink()
    late = await put(again, 500, 64 * 1024)
    assert read_all(again, late) == blob(500, 64 * 1024)[1]
    await again.close()


def test_full_scan_only_after_an_unclean_stop(tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path])
        assert store.recovery.full_scan  # a new cache was never closed cleanly
        await put(store, 1)
        await store.close()
        stray, data = blob(2)
        (tmp_path / "blobs" / stray[:2]).mkdir(exist_ok=True)
        (tmp_path / "blobs" / stray[:2] / stray).write_bytes(data)
        (tmp_path / "tmp" / "left.1.2").write_bytes(b"x")
        quick = await Store.open([tmp_path])
        assert not quick.recovery.full_scan and not quick.has(stray)
        assert quick.recovery.temps_removed == 1  # temps are always cleared
        quick.index.close()  # stop without the clean mark, like a crash
        quick.blobs.release()
        after_crash = await Store.open([tmp_path])
        assert after_crash.recovery.full_scan and after_crash.has(stray)
        await after_crash.close()
        forced = await Store.open([tmp_path], full_recovery=True)
        assert forced.recovery.full_scan and forced.recovery.strays_adopted == 0
        await forced.close()

    run(go())


def test_no_budget_means_free_space_is_the_budget() -> None:
    """Budget 0 on a full disk evicts by policy instead of failing every miss."""
    mnt = _mount_tmpfs("8m")
    try:
        run(_free_space_scenario(mnt))
        assert fsck([mnt]).exit_code == 0
    finally:
        _umount(mnt)


async def _free_space_scenario(mnt: Path) -> None:
    store = await Store.open([mnt])
    hot = await put(store, 0, 1024 * 1024)
    for i in range(1, 20):
        store.touch(hot)
        await put(store, i, 1024 * 1024)
    st = store.stats()
    assert st["evictions"] > 0 and st["entries"] < 20 and store.has(hot)
    assert read_all(store, blob(19, 1024 * 1024)[0]) == blob(19, 1024 * 1024)[1]
    assert list((mnt / "tmp").iterdir()) == []
    await store.close()
