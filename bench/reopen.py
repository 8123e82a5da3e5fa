"""The first reads after a daemon restart (every blob hashed on its first open) vs raw reads.

A checkpoint with K3's real expert shapes (17,547,264 bytes an expert) is served by ``cachecd
hub serve``; a daemon caches every expert once. Then, each round:
  restart the daemon on the same cache (a new process: no blob is verified yet);
  ours: ``client.experts(repo, layer, ids, out=buffers)``, the FIRST call for those experts
        since the restart: the daemon opens each blob and hashes it (xxh3-128 against its name)
        before handing out its fd, then the client reads it;
  raw:  open the same blob files and ``parallel_preadv`` them into the same buffers.
Both read the page cache (the blobs were just read). Prints GiB/s both and how many blobs the
daemon hashed on open each round (it must be the experts asked for). The last line is
``ratio=raw time / our time`` (medians over rounds).

    python bench/reopen.py [--ids 16] [--readers 4] [--rounds 7] [--dir /tmp]
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash
from _common import (
    GIB,
    K3_SHAPE,
    Served,
    add_common_args,
    close_all,
    median,
    open_all,
    served_checkpoint,
    timed,
)

from cachecd_client.transport import parallel_preadv

REPO = "bench/k3-shaped"


@dataclass
class ReopenResult:
    ours_s: list[float]
    raw_s: list[float]
    hashed_per_round: list[int]  # blobs the daemon hashed on open, each round
    bytes_per_call: int

    @property
    def ratio(self) -> float:
        return median(self.raw_s) / median(self.ours_s)


def measure(served: Served, *, n_ids: int, readers: int, rounds: int) -> ReopenResult:
    m = served.manifest
    layers = list(m.moe_layers)
    ids = list(range(min(n_ids, m.experts_per_layer)))
    sizes = {layer: [m.expert(layer, e).nbytes for e in ids] for layer in layers}
    bufs = [np.ones(int(m.sizes.max()), np.uint8) for _ in ids]
    views = [memoryview(b) for b in bufs]
    res = ReopenResult([], [], [], sum(sizes[layers[0]]))
    # The scrub off: it would hash some blobs before the first call does, and the first call's
    # own hashing is what this measures.
    d = served.daemon(args=("--scrub-rate", "0"))
    try:
        with d.client(readers=readers) as c:
            for layer in layers:
                c.experts(served.repo, layer, ids)
            c.stats()  # the commits are done: every blob is in place
        paths = {layer: served.blob_paths(d.cache_dir, layer, ids) for layer in layers}
        with ThreadPoolExecutor(readers) as pool:
            for r in range(rounds + 1):  # round 0 warms up
                layer = layers[r % len(layers)]
                d.stop()
                d.start()
                with d.client(readers=readers) as c:
                    t_ours = timed(lambda: c.experts(served.repo, layer, ids, out=bufs))  # noqa: B023
                    for e, b in zip(ids, bufs, strict=True):
                        entry = m.expert(layer, e)
                        if xxhash.xxh3_128(b[: entry.nbytes]).digest() != entry.xxh3:
                            raise SystemExit(f"layer {layer} expert {e}: wrong bytes")
                    hashed = c.stats()["store"]["verified_on_open"]
                fds = open_all(paths[layer])
                try:
                    t_raw = timed(lambda: parallel_preadv(pool, fds, sizes[layer], views))  # noqa: B023
                finally:
                    close_all(fds)
                if r:
                    res.ours_s.append(t_ours)
                    res.raw_s.append(t_raw)
                    res.hashed_per_round.append(hashed)
                    print(f"round {r}: ours={t_ours * 1e3:.1f}ms raw={t_raw * 1e3:.1f}ms "
                          f"ratio={t_raw / t_ours:.3f}", flush=True)  # fmt: skip
    finally:
        served.drop(d)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, rounds=7)
    ap.add_argument("--ids", type=int, default=16, help="experts per call (K3 routes 16)")
    ap.add_argument("--readers", type=int, default=4, help="reader threads, both paths")
    args = ap.parse_args(argv)
    opts = dict(experts=args.ids, layers=3, shard_bytes=4 << 30, top_k=4, **K3_SHAPE)
    with served_checkpoint(args.dir, REPO, **opts) as served:
        res = measure(served, n_ids=args.ids, readers=args.readers, rounds=args.rounds)
    moved = res.bytes_per_call
    print(f"reopen: {args.ids} experts, {moved} B, the first call after each restart")
    print(
        f"ours GiB/s={moved / median(res.ours_s) / GIB:.2f}   "
        f"raw GiB/s={moved / median(res.raw_s) / GIB:.2f}"
    )
    print(f"info: blobs hashed on open per round={sorted(set(res.hashed_per_round))}")
    print(f"ratio={res.ratio:.3f}")


if __name__ == "__main__":
    main()
