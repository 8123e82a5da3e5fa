"""Warm hits through the daemon vs raw parallel preadv of the same blob files.

A checkpoint with K3's real expert shapes (17,547,264 bytes an expert) and a few layers is
served by ``cachecd hub serve``; a daemon caches every expert (one warm-up pass). Then, in
alternating rounds:
  ours: ``client.experts(repo, layer, ids, out=buffers)`` for 16 experts of a layer (one K3
        token's worth of one layer), the layer cycling;
  raw:  open the SAME blob files (CACHE/blobs/xx/<digest>), ``parallel_preadv`` them into the
        same preallocated buffers with a pool as large as the client's, close them.
Both read the page cache (the blobs were just written or read). Prints GiB/s both; the bar is
ratio >= 0.95.

    python bench/hits.py [--experts 16] [--layers 3] [--ids 16] [--reps 4] [--readers 4]
                         [--rounds 15] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
from _common import (
    GIB,
    K3_SHAPE,
    Served,
    add_common_args,
    alternate,
    close_all,
    median,
    open_all,
    paired_ratio,
    proc_cpu_s,
    served_checkpoint,
    timed,
    touched_buffers,
)

from cachecd_client.transport import parallel_preadv

REPO = "bench/k3-shaped"


@dataclass
class HitsResult:
    ours_gibs: float
    raw_gibs: float
    bytes_per_case: int
    daemon_cpu_ms: float  # the daemon's CPU per ``client.experts`` call, all rounds together
    paired: float  # median of the per-round ratios

    @property
    def ratio(self) -> float:
        return self.ours_gibs / self.raw_gibs


def _check(served: Served, layer: int, ids: list[int], bufs: list[np.ndarray], who: str) -> None:
    for e, buf in zip(ids, bufs, strict=True):
        entry = served.manifest.expert(layer, e)
        if xxhash.xxh3_128(buf[: entry.nbytes]).digest() != entry.xxh3:
            raise SystemExit(f"{who}: layer {layer} expert {e} bytes do not match the manifest")


def measure(served: Served, *, n_ids: int, reps: int, readers: int, rounds: int) -> HitsResult:
    """Warm the daemon, then alternate ours/raw; GiB/s are medians over rounds."""
    m = served.manifest
    layers = list(m.moe_layers)
    ids = list(range(min(n_ids, m.experts_per_layer)))
    size = int(m.sizes.max())
    with (
        served.running_daemon() as d,
        d.client(readers=readers) as client,
        ThreadPoolExecutor(readers) as pool,
    ):
        for layer in layers:  # the warm-up pass: every expert fetched, verified, cached
            client.experts(served.repo, layer, list(range(m.experts_per_layer)))
        client.stats()  # answers once the warm-up's commits are done: every blob is in place
        paths = {layer: served.blob_paths(d.cache_dir, layer, ids) for layer in layers}
        sizes = {layer: [m.expert(layer, e).nbytes for e in ids] for layer in layers}
        bufs = touched_buffers(len(ids), size)
        views = [memoryview(b) for b in bufs]
        cycle = itertools.cycle(layers)

        pid = d.proc.pid if d.proc else 0
        daemon_cpu = [0.0]

        def ours() -> None:
            c0 = proc_cpu_s(pid)
            for _ in range(reps):
                client.experts(served.repo, next(cycle), ids, out=bufs)
            daemon_cpu[0] += proc_cpu_s(pid) - c0

        def raw() -> None:
            for _ in range(reps):
                layer = next(cycle)
                fds = open_all(paths[layer])
                try:
                    parallel_preadv(pool, fds, sizes[layer], views)
                finally:
                    close_all(fds)

        for layer in layers:  # both paths deliver the manifest's bytes
            client.experts(served.repo, layer, ids, out=bufs)
            _check(served, layer, ids, bufs, "daemon")
            bufs_raw = [b.copy() for b in bufs]
            for b in bufs:
                b.fill(0)
            fds = open_all(paths[layer])
            parallel_preadv(pool, fds, sizes[layer], views)
            close_all(fds)
            _check(served, layer, ids, bufs, "raw")
            assert all(np.array_equal(a, b) for a, b in zip(bufs, bufs_raw, strict=True))
            del bufs_raw
        per_case = reps * len(ids) * size

        def rate(k: str, t: float) -> str:
            return f"{k}={per_case / t / GIB:.2f}GiB/s"

        times = alternate({"ours": lambda: timed(ours), "raw": lambda: timed(raw)}, rounds, rate)
    return HitsResult(
        per_case / median(times["ours"]) / GIB,
        per_case / median(times["raw"]) / GIB,
        per_case,
        daemon_cpu[0] * 1e3 / ((rounds + 1) * reps),
        paired_ratio(times["raw"], times["ours"]),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, rounds=15)
    ap.add_argument("--experts", type=int, default=16, help="experts per layer in the checkpoint")
    ap.add_argument("--layers", type=int, default=3, help="model layers (the first is dense)")
    ap.add_argument("--ids", type=int, default=16, help="experts per call (K3 routes 16)")
    ap.add_argument("--reps", type=int, default=4, help="calls per measurement")
    ap.add_argument("--readers", type=int, default=4, help="reader threads, both paths")
    args = ap.parse_args(argv)
    opts: dict[str, Any] = dict(
        experts=args.experts,
        layers=args.layers,
        shard_bytes=4 << 30,
        top_k=min(4, args.experts),
        **K3_SHAPE,
    )
    with served_checkpoint(args.dir, REPO, **opts) as served:
        res = measure(
            served, n_ids=args.ids, reps=args.reps, readers=args.readers, rounds=args.rounds
        )
    print(
        f"hits: {args.ids} experts x {res.bytes_per_case // args.reps // args.ids} B, "
        f"{args.reps} calls/measurement, readers={args.readers}, rounds={args.rounds}"
    )
    print(
        f"ours (daemon, fds + parallel preadv) GiB/s={res.ours_gibs:.2f}   "
        f"raw (open + parallel preadv)        GiB/s={res.raw_gibs:.2f}"
    )
    print(
        f"info: daemon CPU per call={res.daemon_cpu_ms:.2f} ms (clock ticks, coarse); "
        f"one call moves {res.bytes_per_case // args.reps} B"
    )
    print(f"info: median of per-round ratios={res.paired:.3f}")
    print(f"ratio={res.ratio:.3f}")


if __name__ == "__main__":
    main()
