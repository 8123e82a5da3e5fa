"""Experts into the arrays the kernel reads, at K3's real size, vs raw parallel preadv.

A checkpoint with K3's real expert shapes (17,547,264 bytes an expert) is served by
``cachecd hub serve``, installed with ``cachecd setup --stream`` (which starts a daemon), and
every expert is cached on disk (one warm-up pass). Then, in alternating rounds, for 16 experts
of a layer (one K3 token's routing of one layer), the layer cycling:
  ours: the engine's ``ExpertBank.load_stack(layer, ids)`` through the daemon, the experts
        dropped from the pool first so each is read again: one request, fds passed back,
        ``preadv`` straight into free slots of the pool (the arrays the kernel reads);
  unchecked: ours with the check of every expert's bytes against its xxh3-128 off
        (``DaemonSource.verify``; on by default, hashed on the reader threads as windows land);
  raw:  open the SAME blob files, ``parallel_preadv`` them into preallocated buffers with a
        pool as large as the client's, close them.
Both read the page cache. Before the rounds, ours is checked against the manifest: every
slot's bytes equal the expert's bytes in the checkpoint. Prints GiB/s both and the bytes the
host wrote into memory per expert byte delivered (counted where they are written: the bytes
each ``preadv`` into a slot returned); the bar is ratio >= 0.9. ``check_ratio`` is ours /
unchecked (the check's cost; bar >= 0.95, issue 48).

    python bench/k3_delivery.py [--experts 32] [--layers 4] [--ids 16] [--reps 4] [--readers 4]
                                [--rounds 15] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from _common import (
    GIB,
    K3_SHAPE,
    Served,
    add_common_args,
    alternate,
    close_all,
    installed,
    median,
    open_all,
    paired_ratio,
    served_checkpoint,
    timed,
    touched_buffers,
    warm_disk,
)

from cachecd_client.transport import parallel_preadv

REPO = "bench/k3-slice"


@dataclass
class DeliveryResult:
    ours_gibs: float
    raw_gibs: float
    bytes_per_case: int
    copies_per_expert: float  # bytes written into memory per expert byte delivered
    paired: float
    unchecked_gibs: float = 0.0  # ours with the xxh3-128 check off
    check_paired: float = 0.0  # median of per-round ours / unchecked
    cpu_checked: float = 0.0  # this process's CPU seconds a GiB delivered, check on
    cpu_unchecked: float = 0.0  # the same, check off

    @property
    def ratio(self) -> float:
        return self.ours_gibs / self.raw_gibs


def check_stack(served: Served, bank: Any, layer: int, ids: list[int]) -> None:
    """The arrays the kernel would read hold exactly the experts' checkpoint bytes."""
    arrays = bank.load_stack(layer, ids)
    for e in ids:
        row = bank.table.slot((layer, e))
        entry = served.manifest.expert(layer, e)
        want = _expert_bytes(served.repo_dir, entry)
        got = {}
        for offset, n, (proj, suffix) in bank.pieces(layer, e):
            name = "scales" if suffix == "weight_scale" else "weight"
            arr = np.array(arrays[proj][name][row].view(mx.uint8)).reshape(-1)
            got[offset] = arr.tobytes()[:n]
        if b"".join(got[k] for k in sorted(got)) != want:
            raise SystemExit(f"layer {layer} expert {e}: the stack differs from the checkpoint")


def _expert_bytes(repo_dir: Path, entry: Any) -> bytes:
    parts = []
    for r in entry.ranges:
        with open(repo_dir / r.file, "rb") as fh:
            fh.seek(r.start)
            parts.append(fh.read(r.length))
    return b"".join(parts)


def measure(served: Served, *, n_ids: int, reps: int, readers: int, rounds: int) -> DeliveryResult:
    from cachecd_engine.run import load

    m = served.manifest
    layers = list(m.moe_layers)
    ids = list(range(min(n_ids, m.experts_per_layer)))
    size = int(m.sizes.max())
    with installed(served) as (sock, cache_dir), ThreadPoolExecutor(readers) as pool:
        warm_disk(sock, served)
        model, _ = load(served.repo, sock, ram_bytes=2 * len(ids) * size, prefetch=False)
        bank = model.bank
        for layer in layers:
            check_stack(served, bank, layer, ids)
        paths = {layer: served.blob_paths(cache_dir, layer, ids) for layer in layers}
        sizes = {layer: [m.expert(layer, e).nbytes for e in ids] for layer in layers}
        bufs = touched_buffers(len(ids), size)
        views = [memoryview(b) for b in bufs]
        cycle = itertools.cycle(layers)

        def ours(check: bool = True) -> None:
            bank.source.verify = check
            for _ in range(reps):
                layer = next(cycle)
                bank.drop(layer, ids)
                bank.load_stack(layer, ids)
            bank.source.verify = True

        def raw() -> None:
            for _ in range(reps):
                layer = next(cycle)
                fds = open_all(paths[layer])
                try:
                    parallel_preadv(pool, fds, sizes[layer], views)
                finally:
                    close_all(fds)

        per_case = reps * len(ids) * size

        def rate(k: str, t: float) -> str:
            return f"{k}={per_case / t / GIB:.2f}GiB/s"

        cpu: dict[bool, list[float]] = {True: [], False: []}

        def ours_cpu(check: bool) -> float:
            # CPU seconds beside the wall time: on a shared machine the wall time swings with
            # the other processes' load, what the check costs in CPU does not.
            c0 = time.process_time()
            t = timed(lambda: ours(check))
            cpu[check].append(time.process_time() - c0)
            return t

        bank.stats.reset()
        times = alternate({"ours": lambda: ours_cpu(True), "raw": lambda: timed(raw),
                           "unchecked": lambda: ours_cpu(False)}, rounds, rate)
        s = bank.stats
        copies = s.copied_bytes / max(1, s.source_hits * size)
        if bank.source.client.checksum_mismatches:
            raise SystemExit("an expert failed its check: the bench's cache is corrupt")
        bank.close()
        bank.source.close()
    return DeliveryResult(
        per_case / median(times["ours"]) / GIB,
        per_case / median(times["raw"]) / GIB,
        per_case,
        copies,
        paired_ratio(times["raw"], times["ours"]),
        per_case / median(times["unchecked"]) / GIB,
        paired_ratio(times["unchecked"], times["ours"]),
        median(cpu[True][1:]) / (per_case / GIB),
        median(cpu[False][1:]) / (per_case / GIB),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, rounds=15)
    ap.add_argument("--experts", type=int, default=32, help="experts per layer in the checkpoint")
    ap.add_argument("--layers", type=int, default=4, help="model layers (the first is dense)")
    ap.add_argument("--ids", type=int, default=16, help="experts per call (K3 routes 16)")
    ap.add_argument("--reps", type=int, default=4, help="calls per measurement")
    ap.add_argument("--readers", type=int, default=4,
                    help="reader threads of the raw path (the client's default is 4)")
    args = ap.parse_args(argv)
    opts: dict[str, Any] = dict(
        experts=args.experts,
        layers=args.layers,
        shard_bytes=4_000_000_000,
        top_k=min(16, args.experts),
        **K3_SHAPE,
    )
    with served_checkpoint(args.dir, REPO, **opts) as served:
        res = measure(
            served, n_ids=args.ids, reps=args.reps, readers=args.readers, rounds=args.rounds
        )
    print(
        f"k3_delivery: {args.ids} experts x {res.bytes_per_case // args.reps // args.ids} B a "
        f"call, {args.reps} calls/measurement, readers={args.readers}, rounds={args.rounds}"
    )
    print(
        f"ours (bank.load_stack via daemon, into slots) GiB/s={res.ours_gibs:.2f}   "
        f"raw (open + parallel preadv) GiB/s={res.raw_gibs:.2f}"
    )
    print(f"unchecked (ours, xxh3-128 check off) GiB/s={res.unchecked_gibs:.2f}   "
          f"check_ratio (ours / unchecked)={res.ours_gibs / res.unchecked_gibs:.3f}, median of "
          f"per-round ratios {res.check_paired:.3f} (bar >= 0.95)")
    print(f"info: this process's CPU a GiB delivered: {res.cpu_checked:.3f} s checked, "
          f"{res.cpu_unchecked:.3f} s unchecked (x{res.cpu_checked / res.cpu_unchecked:.3f})")
    print(f"info: bytes written per expert byte delivered (ours)={res.copies_per_expert:.2f}")
    print(f"info: median of per-round ratios={res.paired:.3f}")
    print(f"ratio={res.ratio:.3f}")


if __name__ == "__main__":
    main()
