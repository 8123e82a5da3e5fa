"""Proven Xet reads vs resolve + Range reads of the same K3-sized experts, side by side.

A checkpoint with K3's real expert shapes (17,547,264-byte experts) is served by ``cachecd hub
serve``, which keeps its shards in Xet as the Hub does (xorbs of LZ4-or-stored chunks, a content
store under /_xet). One process, alternating rounds, each fetching one layer's experts through
``fetch.Upstream`` (so each expert is one request, ``MAX_PARALLEL_FETCHES`` at a time, every
expert's xxh3 checked against the manifest, as the daemon fetches):
  ours: ``XetSource`` (the daemon's source): per expert, the proof (``/v2/file-chunk-hashes``),
        the window's reconstruction, its signed xorb ranges in parallel, chunks decoded and
        hashed with keyed BLAKE3 on threads, the window proven against the file's Xet hash,
        the expert cut from it;
  plain: ``HubClient`` (the route before): the file resolved once, each expert one exact Range
        GET of the signed location.
Both read the hub's files from the page cache, over loopback, with the hub on the same cores.
Prints MB/s of each, the proof bytes and the window's extra bytes per expert, and the hashing
time per expert; the bar is ratio >= 0.9.

    python bench/xet.py [--experts 8] [--layers 2] [--rounds 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from _common import (
    K3_SHAPE,
    Served,
    add_common_args,
    alternate,
    median,
    paired_ratio,
    proc_cpu_s,
    served_checkpoint,
)

from cachecd.upstream.fetch import Upstream
from cachecd.upstream.hub_client import HubClient
from cachecd.upstream.xet_cache import ChunkCache
from cachecd.upstream.xet_source import XetSource

REPO = "bench/k3-xet"


@dataclass
class XetResult:
    xet_mbs: float
    plain_mbs: float
    ratio: float
    experts: int
    expert_bytes: int
    proof_bytes_per_expert: float
    window_extra_bytes_per_expert: float
    hash_ms_per_expert: float
    xorb_bytes_per_expert: float
    cpu_ms_per_expert: dict[str, float]  # median CPU a round, per expert: {route}_{bench,hub}


class _Sink:
    """Takes each verified expert as the daemon's commit would (a copy out of the buffer)."""

    def __init__(self) -> None:
        self.n = 0

    async def __call__(self, entry: Any, data: Any) -> None:
        self.n += len(memoryview(data))


def measure(served: Served, rounds: int) -> XetResult:
    manifest = served.manifest
    layer = manifest.moe_layers[-1]
    entries = [manifest.expert(layer, e) for e in range(manifest.experts_per_layer)]
    nbytes = sum(e.nbytes for e in entries)
    loop = asyncio.new_event_loop()
    xet = Upstream(XetSource(HubClient(served.hub.url, False)))
    plain = Upstream(HubClient(served.hub.url, False))

    cpu: dict[str, list[float]] = {}
    me, hub = os.getpid(), served.hub.proc.pid

    def run(up: Upstream, name: str) -> float:
        sink = _Sink()
        if name == "xet":  # every round reads cold, as the plain route does: no chunk kept
            up.source.kept = ChunkCache(up.source.kept.limit)  # from the round before
        c0, h0, t0 = proc_cpu_s(me), proc_cpu_s(hub), time.perf_counter()
        failures = loop.run_until_complete(up.fetch_experts(manifest, entries, sink))
        took = time.perf_counter() - t0
        cpu.setdefault(f"{name}_bench", []).append((proc_cpu_s(me) - c0) / len(entries) * 1e3)
        cpu.setdefault(f"{name}_hub", []).append((proc_cpu_s(hub) - h0) / len(entries) * 1e3)
        assert not failures and sink.n == nbytes, failures
        return nbytes / took / 1e6

    try:
        before = xet.stats()
        out = alternate({"xet": lambda: run(xet, "xet"), "plain": lambda: run(plain, "plain")},
                        rounds,
                        lambda k, v: f"{k}_mbs={v:.0f}")
        after = xet.stats()
    finally:
        loop.run_until_complete(xet.close())
        loop.run_until_complete(plain.close())
        loop.close()
    reads = (rounds + 1) * len(entries)  # the warm-up round counts in the stats too

    def per(key: str) -> float:
        return (after.get(key, 0) - before.get(key, 0)) / reads

    return XetResult(
        xet_mbs=median(out["xet"]), plain_mbs=median(out["plain"]),
        ratio=paired_ratio(out["xet"], out["plain"]), experts=len(entries),
        expert_bytes=entries[0].nbytes, proof_bytes_per_expert=per("xet_proof_bytes"),
        window_extra_bytes_per_expert=per("xet_window_bytes") - nbytes / len(entries),
        hash_ms_per_expert=per("xet_hash_us") / 1000, xorb_bytes_per_expert=per("xet_xorb_bytes"),
        cpu_ms_per_expert={k: median(v[1:]) for k, v in cpu.items()})  # not the warm-up


def report(res: XetResult) -> None:
    print(f"cores={os.cpu_count()} experts={res.experts} expert_bytes={res.expert_bytes} "
          "(hub, bench and hashing threads share the cores)")
    print(f"xet_mbs={res.xet_mbs:.0f} plain_mbs={res.plain_mbs:.0f}")
    print(f"proof_bytes_per_expert={res.proof_bytes_per_expert:.0f} "
          f"window_extra_bytes_per_expert={res.window_extra_bytes_per_expert:.0f} "
          f"xorb_bytes_per_expert={res.xorb_bytes_per_expert:.0f} "
          f"hash_ms_per_expert={res.hash_ms_per_expert:.2f}")
    print("cpu_ms_per_expert " + " ".join(f"{k}={v:.1f}"
                                          for k, v in sorted(res.cpu_ms_per_expert.items())))
    print(f"ratio={res.ratio:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, rounds=5)
    ap.add_argument("--experts", type=int, default=8, help="experts a layer (each one K3 expert)")
    ap.add_argument("--layers", type=int, default=2, help="layers of the checkpoint")
    args = ap.parse_args()
    with served_checkpoint(args.dir, REPO, experts=args.experts, layers=args.layers,
                           top_k=min(4, args.experts), shard_bytes=1 << 30, **K3_SHAPE) as s:
        report(measure(s, args.rounds))


if __name__ == "__main__":
    main()
