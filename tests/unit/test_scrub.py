"""The background scrub over a real store: real temp dirs, real LMDB, real files."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash

from cachecd import constants
from cachecd.store.fsck import fsck
from cachecd.store.scrub import Scrubber, TokenBucket
from cachecd.store.store import Store


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _blob(i: int, size: int) -> tuple[str, bytes]:
    data = random.Random(i).randbytes(size)
    return xxhash.xxh3_128(data).hexdigest(), data


def _store_with(tmp_path: Path, sizes: list[int]) -> tuple[Store, list[str]]:
    store = Store.open_sync([tmp_path])
    digests = []
    for i, size in enumerate(sizes):
        digest, data = _blob(i, size)
        store.commit_sync(digest, data, store.reserve_sync(size))
        digests.append(digest)
    return store, digests


def _path(tmp_path: Path, digest: str) -> Path:
    return tmp_path / "blobs" / digest[:2] / digest


def _flip(path: Path, offset: int) -> None:
    """In place, same length, same inode: what rot under a running daemon looks like."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


def test_token_bucket_pays_back_its_debt_at_the_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=1000, burst=100, clock=clock)
    assert bucket.take(500) == pytest.approx(0.5)  # starts empty: 500 tokens are 0.5 s away
    clock.now += 0.5
    assert bucket.take(100) == pytest.approx(0.1)  # the debt was paid by the wait, no more
    clock.now += 10  # idle: saves up to the burst only
    assert bucket.take(100) == 0.0
    assert bucket.take(1000) == pytest.approx(1.0)


def test_a_pass_hashes_every_blob_and_quarantines_the_rotten_one(tmp_path: Path) -> None:
    store, digests = _store_with(tmp_path, [5000, 300_000, 70_000])
    open_fd = os.open(_path(tmp_path, digests[1]), os.O_RDONLY)  # a reader holds it meanwhile
    try:
        _flip(_path(tmp_path, digests[1]), 123_456)
        scrub = Scrubber(store, rate=1 << 40)
        assert scrub.run_pass() == 3
        status = scrub.status()
        assert (status["blobs"], status["failures"], status["passes"]) == (3, 1, 1)
        assert status["bytes"] == 375_000
        assert status["last_pass"]["failures"] == 1
        assert status["last_failure"]["digest"] == digests[1]
        assert status["pass"]["blobs_done"] == status["pass"]["blobs_total"] == 3
        assert not store.has(digests[1]) and store.has(digests[0]) and store.has(digests[2])
        assert store.stats()["quarantined"] == 1
        assert store.quarantined_since(0, [digests[1]])
        assert not store.quarantined_since(0, [digests[0], digests[2]])
        quarantined = list((tmp_path / "quarantine").iterdir())
        assert [p.name.split(".")[0] for p in quarantined] == [digests[1]]
        assert not store.unverified(digests[0])  # a good hash counts as a verification
    finally:
        os.close(open_fd)
        store.close_sync()
    again = Store.open_sync([tmp_path])  # the row delete went through the writer thread
    try:
        assert sorted(again.digests()) == sorted([digests[0], digests[2]])
    finally:
        again.close_sync()
    assert fsck([tmp_path]).exit_code == 0


def test_a_missing_or_short_blob_loses_its_row(tmp_path: Path) -> None:
    store, digests = _store_with(tmp_path, [4000, 4000, 4000])
    try:
        _path(tmp_path, digests[0]).unlink()
        os.truncate(_path(tmp_path, digests[1]), 100)
        scrub = Scrubber(store, rate=1 << 40)
        scrub.run_pass()
        assert (scrub.counters["missing"], scrub.counters["blobs"]) == (2, 1)
        assert store.digests() == [digests[2]]
    finally:
        store.close_sync()


def test_the_rate_paces_the_pass(tmp_path: Path) -> None:
    """Waits add up to the bytes (or each blob's minimum cost) over the rate."""
    sizes = [1000, 200_000, 300_000]
    store, _ = _store_with(tmp_path, sizes)
    try:
        scrub = Scrubber(store, rate=1 << 20)
        scrub._bucket = TokenBucket(1 << 20, 0, clock=Clock())  # time stands still: all debt
        waits: list[float] = []
        scrub._wait = waits.append  # type: ignore[method-assign]
        scrub.run_pass()
        cost = sum(max(s, constants.SCRUB_MIN_BLOB_COST) for s in sizes)
        assert waits[-1] == pytest.approx(cost / (1 << 20))  # the debt when the last blob began
        assert len(waits) == 3  # paid per blob, before it is opened
    finally:
        store.close_sync()


class Stop:
    """The scrub's stop event on a test clock: waiting moves the clock, nothing stops."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def is_set(self) -> bool:
        return False

    def wait(self, seconds: float) -> bool:
        self.clock.now += seconds
        return False


def _on_clock(scrub: Scrubber, rate: int) -> Clock:
    clock = Clock()
    scrub._bucket = TokenBucket(rate, rate * constants.SCRUB_DEFER_S, clock=clock)
    scrub._stop = Stop(clock)  # type: ignore[assignment]
    scrub._wait = scrub._stop.wait  # type: ignore[method-assign, assignment]
    return clock


def test_demand_comes_first_and_the_pass_keeps_its_window(tmp_path: Path) -> None:
    """While demand fetches are in flight each read waits for them, up to SCRUB_DEFER_S of the
    rate saved up, and then goes: a pass over a cache that is never idle still ends within
    (its bytes / rate) + SCRUB_DEFER_S, as docs/daemon.md promises (it took 4 times as long)."""
    sizes = [1 << 20] * 10
    store, _ = _store_with(tmp_path, sizes)
    try:
        scrub = Scrubber(store, rate=1 << 20, busy=lambda: True)
        clock = _on_clock(scrub, 1 << 20)
        t0 = clock.now
        assert scrub.run_pass() == 10
        took = clock.now - t0
        assert took <= sum(sizes) / (1 << 20) + constants.SCRUB_DEFER_S, took
        assert took >= sum(sizes[:-1]) / (1 << 20), took  # the average rate holds: no faster
        assert scrub.counters["yields"] == 10 and scrub.counters["blobs"] == 10
    finally:
        store.close_sync()


def test_a_small_blob_costs_a_page_not_64_kib(tmp_path: Path) -> None:
    sizes = [5000] * 20
    store, _ = _store_with(tmp_path, sizes)
    try:
        scrub = Scrubber(store, rate=100_000)
        clock = _on_clock(scrub, 100_000)
        scrub._bucket._tokens = 0.0  # type: ignore[union-attr]
        t0 = clock.now
        scrub.run_pass()
        assert clock.now - t0 == pytest.approx(sum(sizes) / 100_000, rel=0.05)  # was 13 s
    finally:
        store.close_sync()


def test_a_blob_evicted_while_the_scrub_waits_is_not_missing(tmp_path: Path) -> None:
    store, digests = _store_with(tmp_path, [4000, 4000])
    try:
        scrub = Scrubber(store, rate=1 << 20)
        clock = _on_clock(scrub, 1 << 20)

        def evict_meanwhile(seconds: float) -> bool:  # the scrub waits for its turn: evict
            store.evict_sync([digests[0]])
            clock.now += seconds
            return False

        scrub._wait = evict_meanwhile  # type: ignore[method-assign, assignment]
        scrub.run_pass()
        assert scrub.counters["missing"] == 0 and scrub.counters["blobs"] == 1, scrub.counters
    finally:
        store.close_sync()


def test_the_thread_passes_rests_wakes_for_a_new_blob_and_stops(tmp_path: Path) -> None:
    store, _ = _store_with(tmp_path, [2000, 2000])
    scrub = Scrubber(store, rate=64 << 20)

    def until(what: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        for _ in range(1000):
            if what(status := scrub.status()):
                return status
            scrub._stop.wait(0.01)
        raise AssertionError(scrub.status())

    try:
        scrub.start()
        rested = until(lambda s: "resting_until" in s)
        assert rested["passes"] == 1 and rested["running"]
        digest, data = _blob(99, 3000)  # a blob comes in: the rest ends, a pass covers it
        store.commit_sync(digest, data, store.reserve_sync(len(data)))
        again = until(lambda s: s["passes"] == 2 and "resting_until" in s)
        assert again["blobs"] == 5
    finally:
        scrub.stop()  # ends the rest at once: it would otherwise last SCRUB_REST_S
        store.close_sync()
    assert not scrub.status()["running"]


def test_off_means_no_thread(tmp_path: Path) -> None:
    store, _ = _store_with(tmp_path, [2000])
    scrub = Scrubber(store, rate=0)
    try:
        scrub.start()
        assert not scrub.status()["running"] and scrub.status()["rate"] == 0
    finally:
        scrub.stop()
        store.close_sync()


def test_a_blob_that_cannot_be_read_counts_as_bad(tmp_path: Path) -> None:
    store, digests = _store_with(tmp_path, [3000, 3000])
    try:
        scrub = Scrubber(store, rate=1 << 40)

        def eio(fd: int, size: int) -> str:
            raise OSError(5, "Input/output error")

        scrub._hash = eio  # type: ignore[method-assign]
        assert scrub.run_pass() == 2
        assert scrub.counters["failures"] == 2 and store.digests() == []
    finally:
        store.close_sync()


def test_passes_are_logged_at_most_once_a_minute_each_line_says_how_many(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store, _ = _store_with(tmp_path, [5000, 7000])
    clock = Clock()
    scrub = Scrubber(store, rate=1 << 40, clock=clock)
    caplog.set_level("INFO", logger="cachecd.store.scrub")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "scrub_pass_done" in r.getMessage()]

    assert scrub.run_pass() == 2
    assert len(lines()) == 1 and "passes=1 blobs=2 bytes=12000 " in lines()[0]
    for _ in range(3):  # within the minute: counted, not logged
        clock.now += 10
        scrub.run_pass()
    assert len(lines()) == 1 and scrub.status()["passes"] == 4
    clock.now += constants.SCRUB_LOG_EVERY_S
    scrub.run_pass()
    assert len(lines()) == 2 and "passes=4 blobs=2 bytes=12000 " in lines()[1]
    store.close_sync()
