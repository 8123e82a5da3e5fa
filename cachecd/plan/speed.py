"""A decode token's time from its parts: compute, plus the bytes it reads at the rate their
source gives.

    token = compute + calls x call + miss calls x (miss call + request)
            + disk bytes / disk rate + Hub bytes / Hub rate

``call`` is what the engine adds to each MoE layer call (the routing read-back, the bank's host
work) and ``miss call`` what a call whose experts are read adds beyond its bytes (both measured
with the engine's own layer: ``probe.engine_costs``). Where a daemon serves the model, the
probe's misses are read through it, so ``miss call`` holds the daemon's round trip as a decode
incurs it and ``request`` is 0 (but for the daemon's cost per expert more or fewer than the
probe's call asked); else ``request`` is the doctor's round trip, asked back to back, which is
lower (on a 2-vCPU machine 0.13-0.32 ms, against 0.32-0.63 ms right after MLX work).
These matter where experts are small (the tiny model: most of a token); at K3's expert size
the bytes dominate.

Nothing overlaps on a token's critical path in the engine as it runs by default: each MoE
layer's routing is read back, its misses are read into slots, then its call is queued, and the
next layer's routing needs that call's output (read-ahead, which would overlap, is off by
default). The disk rate is the page cache's (the doctor's) for the share of the disk cache that
fits beside the pool in memory (warm), the cold rate for the rest (cold: all of it): the engine
probe's, where it could read a call's misses off the disk through the daemon (each read blocks
the call, one after another for small experts: on a 2-vCPU machine 6.5 KB took 63-91 us there,
the doctor's blocks back to back 55-63), else the doctor's at the queue depth a call reaches.
The Hub rate is the doctor's one range; the daemon runs up to ``MAX_PARALLEL_FETCHES`` fetches
at once, so this is the slow side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cachecd import constants
from cachecd.plan.disk_probe import PAGE_CACHE_READERS


@dataclass(frozen=True)
class Machine:
    """The doctor's figures a projection uses (bytes and bytes/s)."""

    total: int
    available: int
    gpu: int | None
    cold_rate: float  # the SSD, page cache bypassed, at the engine's queue depth
    page_rate: float  # the page cache
    hub_rate: float | None  # one range from the endpoint; None: not measured
    resolve_s: float | None
    request_s: float = 0.0  # the daemon's round trip for a layer call's experts; 0: not measured
    cold_by_depth: tuple[tuple[int, float], ...] = ()  # (queue depth, bytes/s), the doctor's
    per_expert_s: float = 0.0  # the daemon's cost per expert of a request beyond the first
    gpu_free: int | None = None  # a discrete GPU's free memory when the doctor ran

    def cold_at(self, depth: float) -> float:
        """The cold rate at the deepest queue the doctor measured that is not deeper."""
        rows = [r for q, r in self.cold_by_depth if q <= max(1.0, depth)]
        return rows[-1] if rows else self.cold_rate

    @classmethod
    def from_doctor(cls, report: dict[str, Any], cache_dir: str | None = None) -> Machine:
        disks = report["disks"]
        disk = next((d for d in disks if d["path"] == cache_dir), disks[0])
        cold = {int(k): float(v) for k, v in disk["cold"].items()}
        qd = min(cold, key=lambda q: (abs(q - PAGE_CACHE_READERS), q))  # the client's readers
        mem, net = report["memory"], report.get("network") or {}
        daemon = report.get("daemon") or {}
        page = float(disk["page_cache"])
        # The round trip less its one expert's bytes (read from the page cache).
        one = daemon.get("expert_bytes", 0) / page
        request = max(0.0, daemon.get("request_s", 0.0) - one)
        per = max(0.0, daemon.get("per_expert_s", 0.0) - one)
        return cls(int(mem["total_bytes"]), int(mem["available_bytes"]), mem.get("gpu_bytes"),
                   cold[qd], page, net.get("range_rate"), net.get("resolve_s"), request,
                   tuple(sorted(cold.items())), per, mem.get("gpu_free_bytes"))


def read_s(nbytes: float, rate: float | None) -> float | None:
    if nbytes <= 0:
        return 0.0
    return nbytes / rate if rate else None


@dataclass(frozen=True)
class Calls:
    """A token's MoE layer calls and the engine's costs per call (seconds)."""

    calls: float = 0.0
    miss_calls: float = 0.0
    call_s: float = 0.0
    miss_call_s: float = 0.0
    misses: float = 0.0  # experts read a token
    # Experts asked of the daemon in the miss call measured (``probe.engine_costs``), whose
    # round trip ``miss_call_s`` then holds; 0: it read a local file, the doctor's round trip
    # (for one expert, and its cost per expert more) is added.
    request_experts: int = 0
    # The rate a call's misses come off the disk at, measured as the engine reads them (the
    # engine probe's cold call through the daemon); None: the doctor's cold rate.
    cold_rate: float | None = None

    def seconds(self, m: Machine) -> float:
        base = self.calls * self.call_s + self.miss_calls * self.miss_call_s
        if self.request_experts:  # experts beyond (or short of) the measured call's
            return base + (self.misses - self.miss_calls * self.request_experts) * m.per_expert_s
        extra = max(0.0, self.misses - self.miss_calls)  # experts beyond each request's first
        return base + self.miss_calls * m.request_s + extra * m.per_expert_s


def queue_depth(call_bytes: float) -> int:
    """Reads in flight for one call's misses of ``call_bytes``: the client's
    ``parallel_preadv`` cuts them into jobs (4 MiB windows, small reads grouped until a job
    holds 256 KiB) run by its readers."""
    jobs = max(1, math.ceil(call_bytes / (4 << 20)), math.floor(call_bytes / (256 << 10)))
    return min(PAGE_CACHE_READERS, jobs)


def token_s(compute_s: float, disk_bytes: float, hub_bytes: float, m: Machine,
            page_share: float, calls: Calls | None = None) -> float | None:
    """One token's seconds; None when it needs a rate the doctor did not measure (the Hub's).
    Cold reads go at the rate the engine probe measured them at, else at the doctor's rate for
    the queue depth a call's misses reach."""
    cached = read_s(disk_bytes * page_share, m.page_rate)
    per_call = disk_bytes / calls.miss_calls if calls and calls.miss_calls else disk_bytes
    rate = calls.cold_rate if calls and calls.cold_rate else m.cold_at(queue_depth(per_call))
    cold = read_s(disk_bytes * (1 - page_share), rate)
    hub = read_s(hub_bytes, m.hub_rate)
    if cached is None or cold is None or hub is None:
        return None
    return compute_s + (calls.seconds(m) if calls else 0.0) + cached + cold + hub


def page_share(m: Machine, pool_bytes: int, disk_cached: int) -> float:
    """The share of the disk cache's bytes the page cache can hold beside the pool: the
    memory available less the pool, over what the disk cache holds."""
    room = max(0, m.available - pool_bytes)
    return 1.0 if disk_cached <= room else room / disk_cached


def first_token_s(compute_s: float, token_bytes: int, shards: int, m: Machine) -> float | None:
    """A first token with nothing cached: every routed byte from the Hub, and one resolve per
    shard it touches, ``MAX_PARALLEL_FETCHES`` at a time."""
    if not m.hub_rate or m.resolve_s is None:
        return None
    resolves = -(-shards // constants.MAX_PARALLEL_FETCHES) * m.resolve_s
    return compute_s + resolves + token_bytes / m.hub_rate
