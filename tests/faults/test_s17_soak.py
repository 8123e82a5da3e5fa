"""Scenario 17: a soak. Engine-like clients decode (16 experts a call, layer after layer; from
one token to the next a layer keeps most of its experts, and the new ones come from a popularity
that all clients share, as routing does) while another client warms, asks for status and
coverage and evicts, under a budget that holds 40 % of the experts, with the background scrub
running, and an upstream that answers 503s, stalls mid-body and flips bytes. It runs
--soak-seconds (default 60; $CACHECD_SOAK_SECONDS), longer by flag.

Asserted: every byte served matches the manifest (``check_bytes``); blobs/ + tmp/ never pass the
budget (sampled every 50 ms); the scrub completes passes and finds nothing wrong on disk; and
after the warm-up (the first quarter) the daemon's RSS, fds and asyncio tasks do not grow. Under
load those swing with the work in flight (temps, fetches, connections), so they are compared at
quiet checkpoints: every sixth of the run (at least 5 s) the clients pause, the daemon's fetches
end and its blob fd cache closes, and RSS, fds (less the upstream's keep-alive connections) and
tasks are read, with the requests served so far. RSS is bounded per request: the slope of RSS
over requests served across the checkpoints after the warm-up (least squares) may be at most
LEAK_PER_REQUEST plus the allocator's jitter (RSS_JITTER) spread over those requests, so the
longer the run the tighter the bound (60 s, about 1,300 requests: 3.7 KB a request; ten
minutes: under 1 KB; a leak of 7 KB a call fails both, where "8 MiB + 5 %" let it pass in 60 s).
fds and tasks may exceed the first checkpoint after the warm-up by 4 at the last.
Reported: calls and experts served, p50/p99 latency of calls that were all hits, peak RSS.

It runs 60 s in the suite; ``--soak`` runs it for ten minutes (``--soak-seconds N`` for N).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachecd import constants
from cachecd.errors import CachecdError
from tests.fakes.fake_hub import Faults
from tests.faults.conftest import soak_seconds
from tests.faults.figures import FIGURES
from tests.faults.hubs import RecordingHub
from tests.faults.support import (
    DiskSampler,
    FaultDaemon,
    Model,
    build_model,
    check_bytes,
    check_error,
    fd_census,
    rss_bytes,
)

MIB = 1 << 20
BUDGET = 4 * MIB  # 40 % of the model's 10 MB of experts: evictions all the time
SCRUB_RATE = 2 * MIB  # a pass over the cache every few seconds
DECODERS = 4
PER_CALL = 16
RATES = {"503": 0.05, "flip_byte": 0.03, "stall": 0.02}  # of CDN GETs
# Errors a decode may end in when an expert's fetch keeps failing: typed, retryable or bounded.
EXPECTED = {"upstream_error", "upstream_timeout", "checksum_mismatch", "bad_upstream_range",
            "reservations_full"}
WARMUP = 0.25  # of the run: the cache fills, the allocator settles
LEAK_PER_REQUEST = 512  # bytes of RSS a request may leave behind, at most
RSS_JITTER = 4 * MIB  # what the allocator and the clients swing by between quiet checkpoints
COUNT_SLACK = 4


class SoakHub(RecordingHub):
    """Each CDN GET: a 503, a flipped byte, a stall halfway through the body, or clean. The
    faults are set before the answer's first await, so swapping them per request is safe on the
    hub's single-threaded loop."""

    rng = random.Random(17)

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.injected: Counter[str] = Counter()

    async def _cdn_answer(self, request: Any, kind: str) -> Any:
        fault, r = None, self.rng.random()
        for name, rate in RATES.items():
            if kind == "cdn_get" and r < rate:
                fault = name
                break
            r -= rate
        if fault == "503":
            self.faults = Faults(status_script=[503])
        elif fault == "flip_byte":
            self.faults = Faults(flip_byte=True)
        elif fault == "stall":
            length = _range_length(request.headers.get("Range"))
            self.faults = Faults(stall_after=max(1, length // 2))
        else:
            self.faults = Faults()
        if fault:
            self.injected[fault] += 1
        return await super()._cdn_answer(request, kind)


def _range_length(value: str | None) -> int:
    first, _, last = (value or "bytes=0-0")[6:].partition("-")
    return int(last) - int(first) + 1 if first.isdigit() and last.isdigit() else 2


@pytest.fixture(scope="module")
def soak_model(fault_root: Path) -> Model:
    """4 MoE layers of 96 experts of 26 KB (10 MB)."""
    return build_model(fault_root, "faults/soak", experts=96, layers=5, expert_hidden=128,
                       moe_intermediate=128, shard_bytes=4 << 20)


class Run:
    """What the clients saw, shared by their threads."""

    def __init__(self, model: Model, seconds: float) -> None:
        self.model, self.seconds = model, seconds
        self.stop = threading.Event()
        self.mu = threading.Lock()
        self.hit_ms: list[float] = []
        self.miss_ms: list[float] = []
        self.experts = 0
        self.errors: Counter[str] = Counter()
        self.messages: dict[str, str] = {}  # the first message of each error code
        self.ops: Counter[str] = Counter()
        self.go = threading.Event()  # cleared for a quiet checkpoint: no new call starts
        self.go.set()
        self.active = 0  # client calls under way
        self.peak_rss = 0
        self.checkpoints: list[dict[str, float]] = []
        # Routing is shared: every decoder prefers the same experts of a layer (Zipf-like).
        n = model.manifest.experts_per_layer
        self.weights = {layer: [1 / (1 + rank) ** 0.8 for rank in random.Random(layer).sample(
            range(n), n)] for layer in model.layers}

    def pick(self, rng: random.Random, layer: int, k: int, besides: set[int]) -> list[int]:
        """k distinct experts not in ``besides``, by popularity (Efraimidis-Spirakis)."""
        w = self.weights[layer]
        keys = sorted((e for e in range(len(w)) if e not in besides),
                      key=lambda e: -rng.random() ** (1 / w[e]))
        return keys[:k]

    def route(self, rng: random.Random, layer: int, last: list[int] | None) -> list[int]:
        """The next token's 16 experts: the last token's, with 0-2 of them replaced."""
        if last is None:
            return sorted(self.pick(rng, layer, PER_CALL, set()))
        keep = rng.sample(last, PER_CALL - rng.choice((0, 0, 0, 1, 1, 2)))
        return sorted(keep + self.pick(rng, layer, PER_CALL - len(keep), set(last)))

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """One client call, not started during a quiet checkpoint."""
        self.go.wait()
        with self.mu:
            self.active += 1
        try:
            yield
        finally:
            with self.mu:
                self.active -= 1

    def refused(self, exc: CachecdError) -> None:
        check_error(exc)
        with self.mu:
            self.errors[exc.code] += 1
            self.messages.setdefault(exc.code, exc.message)


def _decode(d: FaultDaemon, run: Run, seed: int) -> None:
    rng = random.Random(seed)
    model = run.model
    routes: dict[int, list[int]] = {}
    with d.client(timeout=60) as c:
        while not run.stop.is_set():
            for layer in model.layers:
                ids = routes[layer] = run.route(rng, layer, routes.get(layer))
                with run.call():
                    before, t0 = c.upstream_fetches, time.perf_counter()
                    try:
                        arrays = c.experts(model.repo, layer, ids)
                    except CachecdError as exc:
                        run.refused(exc)
                        continue
                    took = 1000 * (time.perf_counter() - t0)
                for e, arr in zip(ids, arrays, strict=True):
                    check_bytes(model, model.entry(layer, e), arr)
                with run.mu:
                    (run.hit_ms if c.upstream_fetches == before else run.miss_ms).append(took)
                    run.experts += len(ids)


def _operate(d: FaultDaemon, run: Run) -> None:
    """warm, status, coverage and evict, in turn, a few times a second."""
    rng = random.Random(99)
    with d.client(timeout=60) as c:
        while not run.stop.wait(0.2):
            op = ("warm", "status", "coverage", "evict")[sum(run.ops.values()) % 4]
            with run.call():
                _one_op(c, run, rng, op)
            with run.mu:
                run.ops[op] += 1


def _one_op(c: Any, run: Run, rng: random.Random, op: str) -> None:
    model = run.model
    try:
        if op == "warm":
            layer = rng.choice(model.layers)
            c.warm(model.repo, layer, rng.sample(range(model.manifest.experts_per_layer), 4))
        elif op == "status":
            c.stats()
        elif op == "coverage":
            assert c.coverage(model.repo)["experts_total"] == model.manifest.n_experts
        else:
            c.evict(rng.randrange(256 << 10, 1 << 20))
    except CachecdError as exc:
        run.refused(exc)


def _watch(d: FaultDaemon, run: Run, every: float) -> None:
    """Peak RSS twice a second; a quiet checkpoint every ``every`` seconds and one at the end,
    with every client still connected; then the run stops."""
    t0 = last = time.monotonic()
    with d.client(timeout=60) as c:
        while True:
            time.sleep(0.5)
            run.peak_rss = max(run.peak_rss, rss_bytes(d.pid))
            now = time.monotonic()
            final = now - t0 >= run.seconds
            if not final and now - last < every:
                continue
            run.go.clear()
            try:
                _checkpoint(d, run, c, now - t0)
            finally:
                if final:
                    run.stop.set()
                run.go.set()
            if final:
                return
            last = time.monotonic()


def _checkpoint(d: FaultDaemon, run: Run, c: Any, at: float) -> None:
    """Once the clients' calls and the daemon's fetches are done and its blob fd cache has
    closed its fds (idle for BLOB_FDS_IDLE_S): RSS, fds other than the upstream's keep-alive
    connections, and asyncio tasks, each the least of three looks 0.1 s apart."""
    deadline = time.monotonic() + 60
    while (run.active or c.stats()["inflight"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(constants.BLOB_FDS_IDLE_S + 0.5)
    looks = []
    for _ in range(3):
        looks.append((rss_bytes(d.pid), fd_census(d.pid)["other"], c.stats()["debug"]["tasks"]))
        time.sleep(0.1)
    rss, fds, tasks = (min(look[i] for look in looks) for i in range(3))
    with run.mu:
        requests = len(run.hit_ms) + len(run.miss_ms) + sum(run.errors.values()) + sum(
            run.ops.values())
    run.checkpoints.append({"t": at, "rss": rss, "fds": fds, "tasks": tasks,
                            "requests": requests})


def _growth(run: Run, key: str) -> tuple[float, float]:
    """(the first checkpoint after the warm-up, growth of the last one over it)."""
    after = [p[key] for p in run.checkpoints if p["t"] >= WARMUP * run.seconds]
    assert len(after) >= 2, f"too few checkpoints after the warm-up: {run.checkpoints}"
    return after[0], after[-1] - after[0]


def rss_per_request(points: list[dict[str, float]]) -> tuple[float, float]:
    """(RSS bytes per request: the least-squares slope over ``points``, the bound it must stay
    under: LEAK_PER_REQUEST + RSS_JITTER over the requests the points span)."""
    xs = [p["requests"] for p in points]
    ys = [p["rss"] for p in points]
    assert len(points) >= 2 and xs[-1] > xs[0], points
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)
    return slope, LEAK_PER_REQUEST + RSS_JITTER / (xs[-1] - xs[0])


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_soak_decode_load_with_faults_scrub_and_a_tight_budget(soak_model: Model, pool, request) -> None:  # type: ignore[no-untyped-def]
    seconds = soak_seconds(request.config)
    thread = pool.hub_thread(soak_model, SoakHub)
    d = pool.daemon(thread.hub, [soak_model], args=[
        "--budget", str(BUDGET), "--scrub-rate", str(SCRUB_RATE), "--max-parallel", "4"],
        env={"CACHECD_READ_TIMEOUT": "1", "CACHECD_TOTAL_TIMEOUT": "10"})
    run = Run(soak_model, seconds)
    disk = DiskSampler(d)
    workers = [threading.Thread(target=_decode, args=(d, run, i)) for i in range(DECODERS)]
    workers += [threading.Thread(target=_operate, args=(d, run)),
                threading.Thread(target=_watch, args=(d, run, max(5.0, seconds / 6)))]
    for w in workers:
        w.start()
    try:
        workers[-1].join(seconds + 240)  # the watcher ends the run after its last checkpoint
    finally:
        run.stop.set()
        for w in workers:
            w.join(120)
        disk.stop()
    status = d.status()
    hub: SoakHub = thread.hub  # type: ignore[assignment]
    peak_rss = run.peak_rss
    rss_at, rss_growth = _growth(run, "rss")
    after = [p for p in run.checkpoints if p["t"] >= WARMUP * run.seconds]
    slope, bound = rss_per_request(after)
    fds_at, fds_growth = _growth(run, "fds")
    tasks_at, tasks_growth = _growth(run, "tasks")
    calls = len(run.hit_ms) + len(run.miss_ms)

    FIGURES.setting("s17.soak_seconds", seconds)
    FIGURES.setting("s17.decoders", DECODERS)
    FIGURES.setting("s17.budget_bytes", BUDGET)
    FIGURES.setting("s17.scrub_rate_bytes_per_s", SCRUB_RATE)
    FIGURES.setting("s17.upstream_fault_rates", ", ".join(f"{k} {v:.0%}" for k, v in RATES.items()))
    FIGURES.setting("s17.growth_tolerance", f"RSS {LEAK_PER_REQUEST} B a request + "
                    f"{RSS_JITTER >> 20} MiB over the run, fds {COUNT_SLACK}, tasks {COUNT_SLACK}")
    FIGURES.set("s17.rss_bytes_per_request_after_warmup", round(slope, 1))
    FIGURES.set("s17.rss_bytes_per_request_bound", round(bound, 1))
    FIGURES.set("s17.requests_after_warmup", int(after[-1]["requests"] - after[0]["requests"]))
    FIGURES.set("s17.decode_calls_served", calls)
    FIGURES.set("s17.experts_served", run.experts)
    FIGURES.set("s17.hit_calls", len(run.hit_ms))
    FIGURES.set("s17.hit_latency_p50_ms", round(_percentile(run.hit_ms, 0.5), 2))
    FIGURES.set("s17.hit_latency_p99_ms", round(_percentile(run.hit_ms, 0.99), 2))
    FIGURES.set("s17.miss_calls", len(run.miss_ms))
    FIGURES.set("s17.calls_refused", ", ".join(f"{k} x{v}" for k, v in sorted(run.errors.items()))
                or "none")
    FIGURES.set("s17.control_calls", ", ".join(f"{k} x{v}" for k, v in sorted(run.ops.items())))
    FIGURES.set("s17.evictions", status["store"]["evictions"])
    FIGURES.set("s17.upstream_faults_injected",
                ", ".join(f"{k} x{v}" for k, v in sorted(hub.injected.items())))
    FIGURES.set("s17.scrub_passes", status["scrub"]["passes"])
    FIGURES.set("s17.scrub_blobs_hashed", status["scrub"]["blobs"])
    FIGURES.set("s17.scrub_failures", status["scrub"]["failures"])
    FIGURES.set("s17.peak_blobs_plus_tmp_bytes", disk.peak_total)
    FIGURES.set("s17.disk_samples", disk.samples)
    FIGURES.set("s17.disk_samples_torn", disk.torn)
    FIGURES.set("s17.peak_rss_bytes", peak_rss)
    FIGURES.set("s17.rss_growth_after_warmup_bytes", int(rss_growth))
    FIGURES.set("s17.fds_growth_after_warmup", fds_growth)
    FIGURES.set("s17.tasks_growth_after_warmup", tasks_growth)
    FIGURES.set("s17.quiet_checkpoints", len(run.checkpoints))

    assert calls >= 100 and len(run.hit_ms) >= 50, (calls, len(run.hit_ms))
    assert set(run.errors) <= EXPECTED, run.messages
    assert sum(run.errors.values()) <= calls // 10, run.errors  # faults cost retries, not service
    assert all(v >= 2 for v in run.ops.values()) and len(run.ops) == 4, run.ops  # each, repeatedly
    assert set(hub.injected) == set(RATES), hub.injected
    assert disk.samples >= 10 and disk.peak_total <= BUDGET, disk.peak_total
    assert status["store"]["evictions"] > 0
    assert status["scrub"]["passes"] >= 1 and status["scrub"]["failures"] == 0, status["scrub"]
    assert slope <= bound, (slope, bound, after)  # a leak per request, however small the run
    assert fds_growth <= COUNT_SLACK, (fds_at, fds_growth)
    assert tasks_growth <= COUNT_SLACK, (tasks_at, tasks_growth)
    assert FIGURES.get("all.bad_bytes_served", 0) == 0
