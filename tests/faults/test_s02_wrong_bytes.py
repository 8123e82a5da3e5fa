"""Scenario 2: the hub sends wrong bytes, 1,000 requests' worth. Each CDN answer is picked from a
seeded script: clean, or one of flip_byte, another revision's bytes (serve_from), 200 with the
whole file (ignore_range), a shifted Content-Range, a padded or a short body. Some experts are
poisoned (every answer for them is wrong). Every byte served is checked against the manifest;
a poisoned expert must end in 502 with nothing in the index or under blobs/."""

from __future__ import annotations

import queue
import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cachecd import constants
from cachecd.errors import BadUpstreamRange, ChecksumMismatch
from tests.fakes.fake_hub import Faults
from tests.faults.figures import FIGURES
from tests.faults.hubs import RecordingHub
from tests.faults.support import Model, fetch_verified, files_under

REQUESTS = 1000
FAULT_RATE = 0.3
WORKERS = 16  # most of a faulty request's time is a backoff sleep, not CPU
CHECKSUM_KINDS = ("flip_byte", "serve_from")
RANGE_KINDS = ("ignore_range", "wrong_content_range", "pad_body", "short_body")


def _faults(kind: str, other: Path) -> Faults:
    values: dict[str, Any] = {"flip_byte": {"flip_byte": True}, "serve_from": {"serve_from": other},
                              "ignore_range": {"ignore_range": True},
                              "wrong_content_range": {"wrong_content_range": True},
                              "pad_body": {"pad_body": 10}, "short_body": {"short_body": 10}}[kind]
    return Faults(**values)


class ScriptedHub(RecordingHub):
    """Picks the faults of each CDN GET: a poisoned range always gets its kind, others get a
    random kind FAULT_RATE of the time. ``_send`` reads ``self.faults`` before its first await
    and ``delay`` is 0, so swapping it per request is safe on the single-threaded loop."""

    other: Path
    poison: dict[str, str] = {}
    rng = random.Random(2)
    injected: Counter[str] = Counter()

    async def _cdn_answer(self, request: Any, kind: str) -> Any:
        key = f"{request.match_info['file']} {request.headers.get('Range')}"
        fault = self.poison.get(key)
        if fault is None and kind == "cdn_get" and self.rng.random() < FAULT_RATE:
            fault = self.rng.choice(CHECKSUM_KINDS + RANGE_KINDS)
        self.faults = _faults(fault, self.other) if fault else Faults()
        if fault:
            self.injected[fault] += 1
        return await super()._cdn_answer(request, kind)


def _range_of(entry: Any) -> str:
    """What identifies the expert's first GET: shards with one layout share offsets, so the
    file is part of it."""
    r = entry.ranges[0]
    return f"{r.file} bytes={r.start}-{r.end - 1}"


def _round(d: Any, model: Model, picks: list[tuple[int, int]], outcomes: Counter[str]) -> set[str]:
    """One request per pick, WORKERS clients at a time; returns the digests served."""
    served: set[str] = set()
    mu = threading.Lock()
    clients: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for _ in range(WORKERS):
        clients.put(d.client(timeout=60))

    def one(pick: tuple[int, int]) -> None:
        layer, expert = pick
        c = clients.get()
        try:
            fetch_verified(c, model, layer, [expert])
        except (ChecksumMismatch, BadUpstreamRange) as exc:
            with mu:
                outcomes[exc.code] += 1
            return
        finally:
            clients.put(c)
        with mu:
            outcomes["ok"] += 1
            served.add(model.entry(layer, expert).digest_hex)

    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            list(pool.map(one, picks))
    finally:
        while not clients.empty():
            clients.get().close()
    return served


def _blob_names(d: Any) -> set[str]:
    return {p.name for p in files_under(d.cache_dir / "blobs")}


def test_1000_requests_under_wrong_bytes_serve_no_bad_byte(small: Model, small_other: Model, pool) -> None:  # type: ignore[no-untyped-def]
    ScriptedHub.other = small_other.folder
    thread = pool.hub_thread(small, ScriptedHub)
    hub = thread.hub
    d = pool.daemon(hub, [small], env={"CACHECD_TOTAL_TIMEOUT": "4"})
    everyone = [(e.layer, e.expert) for e in small.all_entries()]
    rng = random.Random(5)
    outcomes: Counter[str] = Counter()
    done, rnd = 0, 0
    while done < REQUESTS:
        picks = rng.sample(everyone, min(len(everyone), REQUESTS - done))
        kinds = (CHECKSUM_KINDS + RANGE_KINDS) if rnd == 0 else CHECKSUM_KINDS
        poisoned = {picks[i]: kinds[i % len(kinds)] for i in range(len(kinds))}
        hub.poison = {_range_of(small.entry(*p)): k for p, k in poisoned.items()}
        hub.clear_records()
        served = _round(d, small, picks, outcomes)
        bad = {small.entry(*p).digest_hex for p in poisoned}
        assert not bad & served
        with d.client() as c:
            c.stats()  # answers once the round's commits are done: its blobs are in place
        assert _blob_names(d) == served, "a blob on disk that was not verified and served"
        for p, kind in poisoned.items():
            want = _range_of(small.entry(*p))
            gets = sum(1 for r in hub.records
                       if r.kind == "cdn_get" and f"{r.path.rsplit('/', 1)[1]} {r.range}" == want)
            if kind in CHECKSUM_KINDS:  # downloaded once plus the bounded refetches, then 502
                assert gets == 1 + constants.CHECKSUM_REFETCHES, (kind, gets)
            else:  # retried with backoff until the attempts or the deadline run out
                assert 2 <= gets <= 1 + constants.MAX_RETRIES, (kind, gets)
        with d.client() as c:
            assert c.stats()["store"]["entries"] == len(served)
            c.evict(1 << 40)  # next round: every request is a miss again
        done += len(picks)
        rnd += 1
    FIGURES.set("s02.requests", done)
    FIGURES.set("s02.served_ok", outcomes["ok"])
    FIGURES.set("s02.refused_502_checksum_mismatch", outcomes["checksum_mismatch"])
    FIGURES.set("s02.refused_502_bad_upstream_range", outcomes["bad_upstream_range"])
    FIGURES.set("s02.corrupt_answers_rejected", sum(hub.injected.values()))
    for kind, n in sorted(hub.injected.items()):
        FIGURES.set(f"s02.injected_{kind}", n)
    FIGURES.set("s02.bad_bytes_served", FIGURES.get("all.bad_bytes_served", 0))
    assert outcomes["ok"] + outcomes["checksum_mismatch"] + outcomes["bad_upstream_range"] == done
    assert FIGURES.get("all.bad_bytes_served", 0) == 0
    assert set(hub.injected) == set(CHECKSUM_KINDS + RANGE_KINDS)

