"""Scenario 7: the disk budget. 40 distinct ~1 MiB experts with Zipf repeats against a 16 MiB
budget while blobs/ and tmp/ are sampled every 50 ms; pins fill the budget (507); an fd handed
out survives the eviction of its blob; a restart with a smaller budget evicts before the socket
exists; an expert bigger than the whole budget is refused at once."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import xxhash

from cachecd import protocol
from cachecd.errors import ReservationsFull, TooLarge
from tests.faults.figures import FIGURES
from tests.faults.support import DiskSampler, FaultDaemon, Model, bytes_under, fetch_verified

MIB = 1 << 20
BUDGET = 16 * MIB


def _zipf_picks(model: Model, n: int, seed: int) -> list[tuple[int, int]]:
    experts = [(e.layer, e.expert) for e in model.all_entries()][:40]
    rng = random.Random(seed)
    return rng.choices(experts, weights=[1 / (k + 1) for k in range(len(experts))], k=n)


def _gets(hub, entry) -> int:  # type: ignore[no-untyped-def]
    first = entry.ranges[0]
    return sum(1 for r in hub.records if r.kind == "cdn_get" and r.path.endswith("/" + first.file)
               and r.range == f"bytes={first.start}-{first.end - 1}")


def _open_fds(d: FaultDaemon, model: Model, layer: int, ids: list[int]) -> list[int]:
    """Raw data-path request: the fds the daemon hands out, held by this test."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(d.socket) + ".data")
    s.sendall(protocol.encode({"op": "experts", "model": model.repo, "layer": layer, "ids": ids}))
    msg, fds, _, _ = socket.recv_fds(s, protocol.MAX_FRAME, protocol.MAX_FDS_PER_FRAME)
    s.close()
    assert protocol.decode(msg[protocol.HEADER.size:])["ok"], msg[:200]
    return list(fds)


def test_budget_under_zipf_load_pins_and_eviction_of_open_blobs(big: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(big)
    hub.faults.delay = 0.08  # a slower upstream stretches the run over more disk samples
    d = pool.daemon(hub, [big], args=["--budget", "16MiB"])
    sampler = DiskSampler(d)
    picks = _zipf_picks(big, 160, seed=1)

    def ask(i: int) -> None:
        with d.client() as c:
            for layer, expert in picks[i::4]:
                fetch_verified(c, big, layer, [expert])

    try:
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(ask, range(4)))
    finally:
        sampler.stop()
    hot = big.entry(*max(set(picks), key=picks.count))
    FIGURES.setting("s07.budget_bytes", BUDGET)
    FIGURES.peak("s07.peak_blobs_bytes", sampler.peak_blobs)
    FIGURES.peak("s07.peak_blobs_plus_tmp_bytes", sampler.peak_total)
    FIGURES.add("s07.disk_samples", sampler.samples)
    FIGURES.add("s07.disk_samples_torn", sampler.torn)
    FIGURES.set("s07.hottest_expert_upstream_fetches", _gets(hub, hot))
    FIGURES.set("s07.zipf_requests", len(picks))
    assert sampler.samples >= 10
    assert sampler.peak_total <= BUDGET, sampler.peak_total
    assert _gets(hub, hot) <= 2, "the hottest expert was evicted again and again"
    with d.client() as c:
        store = c.stats()["store"]
        assert store["bytes"] + store["reserved"] <= BUDGET and store["evictions"] > 0
        FIGURES.set("s07.evictions", store["evictions"])
        # An fd handed out keeps its whole blob even after the blob is evicted.
        layer, ids = hot.layer, [hot.expert]
        fds = _open_fds(d, big, layer, ids)
        assert c.evict(model=big.repo, layer=layer, ids=ids) == hot.nbytes
        try:
            data = os.pread(fds[0], hot.nbytes + 1, 0)
        finally:
            for fd in fds:
                os.close(fd)
        assert len(data) == hot.nbytes and xxhash.xxh3_128(data).digest() == hot.xxh3
        FIGURES.set("s07.evicted_while_held_bytes_read", len(data))
        # Pins fill the budget: the next miss cannot be made room for (retryable 507).
        layer = big.layers[2]
        c.evict(1 << 40)
        pinned = list(range(BUDGET // hot.nbytes))
        c.pin(big.repo, layer, pinned)
        with pytest.raises(ReservationsFull) as info:
            fetch_verified(c, big, big.layers[1], [15])
        assert info.value.retryable and info.value.http_status == 507
        c.unpin(big.repo, layer, pinned)
        fetch_verified(c, big, big.layers[1], [15])  # unpinned: room is made again
    FIGURES.set("s07.reservations_full", f"{info.value.http_status} {info.value.code}")


def test_restart_with_smaller_budget_evicts_before_accepting(big: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(big)
    d = pool.daemon(hub, [big], args=["--budget", "16MiB"])
    with d.client() as c:
        for layer in big.layers[:2]:
            fetch_verified(c, big, layer, list(range(6)))
    assert d.stop() == 0
    assert bytes_under(d.cache_dir / "blobs") > 4 * MIB
    d.extra = ["--budget", "4MiB"]
    seen: list[int] = []

    def watch() -> None:  # the first moment the socket exists, what is on disk?
        deadline = time.monotonic() + 60
        while not d.socket.exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append(bytes_under(d.cache_dir / "blobs"))

    w = threading.Thread(target=watch)
    w.start()
    d.start()
    w.join()
    log = d.log()
    FIGURES.set("s07.blobs_bytes_when_socket_appeared", seen[0])
    assert seen[0] <= 4 * MIB
    assert log.rindex("event=recovery") < log.rindex("listening socket=")
    # An expert bigger than the whole budget: refused at once, no upstream request.
    assert d.stop() == 0
    d.extra = ["--budget", "512KiB"]
    d.start()
    hub.clear_records()
    with d.client() as c, pytest.raises(TooLarge) as info:
        fetch_verified(c, big, big.layers[2], [0])
    assert info.value.http_status == 400 and not info.value.retryable
    assert hub.count() == 0
    assert bytes_under(d.cache_dir / "blobs") == 0  # nothing fits 512 KiB: all evicted at start
    FIGURES.set("s07.too_large_upstream_requests", hub.count())
