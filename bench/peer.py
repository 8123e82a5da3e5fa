"""Experts a second from a peer (``serve --peer``) vs from the local hub, side by side.

A checkpoint with K3's real expert shapes (17,547,264-byte experts) is served by ``cachecd hub
serve``; daemon A (``--share 127.0.0.1:PORT``) holds every expert of the first MoE layer, warm.
Alternating rounds, each a fresh daemon B with an empty cache answering one
``client.experts(repo, layer, ids, out=buffers)`` (the clock stops when the bytes are in the
client's buffers: fetch, xxh3 verify, blob writes, fd hand-over, preadv inside):
  peer: B with ``--peer`` A: ``POST /v2/blobs`` requests side by side (one per K3 expert), A
        sends the blobs with sendfile, B streams them into blob writers, hashing on the way;
  hub:  B without peers: resolve and ranged GETs to the hub (the hub reads its shards from the
        page cache, as A reads its blobs).
Both sides run on this machine over 127.0.0.1: it measures the software path, not a link.
Prints experts/s both; the last line is ``ratio=`` peer / hub (no bar: informational).

    python bench/peer.py [--ids 8] [--experts 16] [--rounds 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import xxhash
from _common import (
    K3_SHAPE,
    Served,
    add_common_args,
    alternate,
    median,
    paired_ratio,
    served_checkpoint,
)

from tests.harness import free_port

REPO = "bench/k3-shaped"


def measure(served: Served, ids: list[int], rounds: int) -> dict[str, Any]:
    m = served.manifest
    layer = m.moe_layers[0]
    entries = [m.expert(layer, e) for e in ids]
    nbytes = sum(e.nbytes for e in entries)
    bufs = [np.ones(e.nbytes, np.uint8) for e in entries]
    token = served.work / "token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    port = free_port()
    a = served.daemon(args=("--share", f"127.0.0.1:{port}", "--share-token-file", str(token)))
    with a.client() as c:
        c.experts(served.repo, layer, ids)  # A holds them, verified by this process
    peer_args = ("--peer", f"http://127.0.0.1:{port}", "--peer-token-file", str(token))

    def fetch(args: tuple[str, ...], want: str) -> float:
        d = served.daemon(args=args)
        try:
            with d.client() as client:
                os.sync()
                t0 = time.perf_counter()
                client.experts(served.repo, layer, ids, out=bufs)
                t = time.perf_counter() - t0
                up = client.stats()["upstream"]
            # The hub's byte requests: Range GETs, or signed xorb GETs where it serves Xet. A
            # peer's experts are proven against the content store's proof for their ranges (the
            # windows' widening read from the hub), and the layout check proves the headers.
            hub_gets = up.get("requests_range", 0) + up.get("requests_xet_xorb", 0)
            got = up.get("peer_experts", 0) if want == "peer" else hub_gets
            from_hub = up.get("xet_windows", 0) - up.get("xet_proven_headers", 0)
            if not got or (want == "peer" and (from_hub > 0 or up.get("peer_unproven", 0))):
                raise SystemExit(f"{want}: the experts did not come from the {want} ({up})")
        finally:
            served.drop(d)
        for e, buf in zip(entries, bufs, strict=True):
            if xxhash.xxh3_128(buf).digest() != e.xxh3:
                raise SystemExit(f"{want}: expert {e.expert} bytes do not match the manifest")
        return t

    def rate(k: str, t: float) -> str:
        return f"{k}={len(ids) / t:.1f}experts/s"

    try:
        times = alternate({"peer": lambda: fetch(peer_args, "peer"),
                           "hub": lambda: fetch((), "hub")}, rounds, rate)
    finally:
        served.drop(a)
    return {"nbytes": nbytes, "peer": len(ids) / median(times["peer"]),
            "hub": len(ids) / median(times["hub"]),
            "paired": paired_ratio(times["hub"], times["peer"])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, rounds=5)
    ap.add_argument("--experts", type=int, default=16, help="experts per layer in the checkpoint")
    ap.add_argument("--ids", type=int, default=8, help="experts in the one cold call")
    args = ap.parse_args(argv)
    opts: dict[str, Any] = dict(experts=args.experts, layers=2, shard_bytes=4 << 30,
                                top_k=min(4, args.experts), **K3_SHAPE)
    with served_checkpoint(args.dir, REPO, **opts) as served:
        ids = list(range(0, args.experts, max(1, args.experts // args.ids)))[:args.ids]
        res = measure(served, ids, args.rounds)
    print(f"peer: {len(ids)} experts ({res['nbytes']} bytes) into a fresh daemon, rounds={args.rounds}")
    print(f"from a peer experts/s={res['peer']:.1f} ({res['nbytes'] / 1e6 * res['peer'] / len(ids):.0f} MB/s)   "
          f"from the hub experts/s={res['hub']:.1f} ({res['nbytes'] / 1e6 * res['hub'] / len(ids):.0f} MB/s)")
    print(f"info: median of per-round ratios={res['paired']:.3f}")
    print(f"ratio={res['peer'] / res['hub']:.3f}")


if __name__ == "__main__":
    main()

