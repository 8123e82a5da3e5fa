"""The daemon's per-request overhead for one K3 token: 92 layers x 16 experts = 1,472 expert reads.

The default tiny model (experts of a few KiB) is served and fully cached, so bytes are negligible
and the per-request cost dominates. In alternating rounds, one "token" is:
  ours: ``client.experts(repo, layer, 16 ids, out=buffers)`` x 92 calls, cycling the model's
        MoE layers (and a different 16 ids each call);
  raw:  for the same 92 (layer, ids): open the same blob files, ``parallel_preadv`` them into the
        same buffers with a pool as large as the client's, close them.
Prints microseconds per expert request and per token for both; ratio = raw time / ours time.

    python bench/overhead.py [--calls 92] [--ids 16] [--readers 4] [--rounds 21] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from _common import (
    Served,
    add_common_args,
    alternate,
    close_all,
    median,
    open_all,
    paired_ratio,
    served_checkpoint,
    timed,
)

import cachecd_client.api as client_api
from cachecd import constants
from cachecd_client.transport import parallel_preadv

REPO = "bench/tiny-k3"


@dataclass
class OverheadResult:
    ours_s: float  # per token (median)
    raw_s: float
    requests: int  # expert requests per token
    split_us: dict[str, float]  # where one call of ours goes, microseconds (see split_call)
    paired: float  # median of the per-round ratios

    @property
    def ratio(self) -> float:
        return self.raw_s / self.ours_s


def plan_token(
    served: Served, calls: int, n_ids: int, seed: int = 0
) -> list[tuple[int, list[int]]]:
    """``calls`` (layer, ids) pairs: the layers cycled, ids drawn like a router would."""
    m = served.manifest
    rng = random.Random(seed)
    n = min(n_ids, m.experts_per_layer)
    layers = m.moe_layers
    return [
        (layers[i % len(layers)], sorted(rng.sample(range(m.experts_per_layer), n)))
        for i in range(calls)
    ]


def measure(served: Served, *, calls: int, n_ids: int, readers: int, rounds: int) -> OverheadResult:
    m = served.manifest
    token = plan_token(served, calls, n_ids)
    with (
        served.running_daemon() as d,
        d.client(readers=readers) as client,
        ThreadPoolExecutor(readers) as pool,
    ):
        for layer in m.moe_layers:  # warm: every expert cached
            client.experts(served.repo, layer, list(range(m.experts_per_layer)))
        client.stats()  # answers once the warm-up's commits are done: every blob is in place
        paths = [served.blob_paths(d.cache_dir, layer, ids) for layer, ids in token]
        sizes = [[m.expert(layer, e).nbytes for e in ids] for layer, ids in token]
        n = len(token[0][1])
        bufs = [np.ones(int(m.sizes.max()), np.uint8) for _ in range(n)]
        views = [memoryview(b) for b in bufs]

        def ours() -> None:
            for layer, ids in token:
                client.experts(served.repo, layer, ids, out=bufs)

        def raw() -> None:
            for p, s in zip(paths, sizes, strict=True):
                fds = open_all(p)
                try:
                    parallel_preadv(pool, fds, s, views)
                finally:
                    close_all(fds)

        def per(k: str, t: float) -> str:
            return f"{k}={t * 1e6 / (calls * n):.1f}us/req"

        times = alternate({"ours": lambda: timed(ours), "raw": lambda: timed(raw)}, rounds, per)
        split = split_call(client, served.repo, token, bufs)
    return OverheadResult(
        median(times["ours"]),
        median(times["raw"]),
        calls * n,
        split,
        paired_ratio(times["raw"], times["ours"]),
    )


def split_call(
    client: Any,
    repo: str,
    token: list[tuple[int, list[int]]],
    bufs: list[np.ndarray],
    tokens: int = 5,
) -> dict[str, float]:
    """Median microseconds a call spends in the data request (daemon round trip, fds received)
    and in reading the fds, over ``tokens`` tokens; and the round trip of an empty request
    (no expert: framing, asyncio and the two context switches alone)."""
    parts: dict[str, list[float]] = {"request": [], "read": [], "call": [], "empty_request": []}
    real_request, real_read = client._data.request, client_api.parallel_preadv

    def request(payload: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return real_request(payload)
        finally:
            parts["request"].append(time.perf_counter() - t0)

    def read(*args: Any) -> None:
        t0 = time.perf_counter()
        try:
            real_read(*args)
        finally:
            parts["read"].append(time.perf_counter() - t0)

    client._data.request, client_api.parallel_preadv = request, read
    try:
        for _ in range(tokens):
            for layer, ids in token:
                t0 = time.perf_counter()
                client.experts(repo, layer, ids, out=bufs)
                parts["call"].append(time.perf_counter() - t0)
    finally:
        client._data.request, client_api.parallel_preadv = real_request, real_read
    for layer, _ in token:
        t0 = time.perf_counter()
        real_request({"op": "experts", "model": repo, "layer": layer, "ids": []})
        parts["empty_request"].append(time.perf_counter() - t0)
    return {k: median(v) * 1e6 for k, v in parts.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, rounds=21)
    ap.add_argument(
        "--calls", type=int, default=constants.K3_MOE_LAYERS, help="layer calls a token"
    )
    ap.add_argument(
        "--ids", type=int, default=constants.K3_EXPERTS_PER_TOKEN, help="experts a call"
    )
    ap.add_argument("--readers", type=int, default=4, help="reader threads, both paths")
    args = ap.parse_args(argv)
    with served_checkpoint(args.dir, REPO) as served:
        size = int(served.manifest.sizes.max())
        res = measure(
            served, calls=args.calls, n_ids=args.ids, readers=args.readers, rounds=args.rounds
        )
    print(
        f"overhead: {res.requests} expert requests a token ({args.calls} calls x {args.ids}), "
        f"expert size {size} B, readers={args.readers}, rounds={args.rounds}"
    )
    print(
        f"ours (daemon) us/req={res.ours_s * 1e6 / res.requests:.1f} "
        f"ms/token={res.ours_s * 1e3:.2f}   "
        f"raw (open+preadv+close) us/req={res.raw_s * 1e6 / res.requests:.1f} "
        f"ms/token={res.raw_s * 1e3:.2f}"
    )
    print(f"daemon overhead per token={(res.ours_s - res.raw_s) * 1e3:.2f} ms")
    sp = res.split_us
    print(
        f"info: one call of ours (us, median): whole={sp['call']:.0f} = data request "
        f"(round trip, daemon opens + passes fds)={sp['request']:.0f} + parallel preadv="
        f"{sp['read']:.0f} + the rest; an empty request's round trip={sp['empty_request']:.0f}"
    )
    print(f"info: median of per-round ratios={res.paired:.3f}")
    print(f"ratio={res.ratio:.3f}")


if __name__ == "__main__":
    main()
