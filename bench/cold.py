"""Cold fetch through a fresh daemon vs curl fetching the same byte ranges from the same endpoint.

A checkpoint with K3's real expert shapes is served by ``cachecd hub serve``. Alternating rounds:
  ours: a fresh daemon (empty cache, started before the clock) answers one
        ``client.experts(repo, layer, ids, out=buffers)``: the clock stops when the bytes are in
        the client's buffers (resolve, ranged GETs, xxh3 verify, blob writes, fd hand-over and
        preadv all inside; each blob's fsync, rename and index commit follow the answer, as in
        production, and finish before the next round: stopping the daemon waits for them);
  curl: one ``curl -sI`` to the resolve URL for the signed Location (as the daemon does), then
        every expert's byte range as its own transfer, ``constants.MAX_PARALLEL_FETCHES`` at a
        time (``curl --parallel``), each into its own file in the same filesystem; every answer
        must be a 206 of exactly the asked length.
Both read the hub's files from the page cache, and each round starts after ``sync`` so neither
pays for the other's dirty pages. Prints MB/s both; the bar is ratio >= 0.9.

    python bench/cold.py [--experts 32] [--ids 16] [--pick random|first] [--rounds 7] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
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
    proc_cpu_s,
    served_checkpoint,
)
from curl_ranges import resolve_locations

from cachecd import constants
from cachecd.durable import full_fsync, sync_dir

REPO = "bench/k3-shaped"


@dataclass
class ColdResult:
    ours_mbs: float
    curl_mbs: float
    nbytes: int
    upstream_requests: int  # ranged GETs the daemon sent in its last round (it coalesces)
    curl_fsync_mbs: float  # curl, then fsync of its files: what durability would cost curl
    cpu_s: dict[str, float]  # median CPU seconds a round: ours_daemon, ours_hub, curl, curl_hub
    paired: float  # median of the per-round ratios

    @property
    def ratio(self) -> float:
        return self.ours_mbs / self.curl_mbs


def pick_ids(served: Served, n: int, how: str, seed: int = 0) -> list[int]:
    per_layer = served.manifest.experts_per_layer
    n = min(n, per_layer)
    if how == "first":
        return list(range(n))
    return sorted(random.Random(seed).sample(range(per_layer), n))


def curl_fetch(served: Served, layer: int, ids: list[int], out_dir: Path, parallel: int) -> None:
    """Resolve once, then every range of every expert into its own file; checked 206 + size."""
    m = served.manifest
    ranges = [r for e in ids for r in m.expert(layer, e).ranges]
    loc = resolve_locations(served.hub.url, m.repo, m.revision, sorted({r.file for r in ranges}))
    cfg = out_dir / "ranges.curlrc"
    cfg.write_text(
        "next\n".join(
            f'url = "{loc[r.file]}"\nrange = "{r.start}-{r.end - 1}"\noutput = "{out_dir / str(i)}"\n'
            'header = "Accept-Encoding: identity"\nwrite-out = "%{http_code} %{size_download}\\n"\n'
            for i, r in enumerate(ranges)
        )
    )
    proc = subprocess.run(
        ["curl", "-sS", "--parallel", "--parallel-max", str(parallel), "-K", str(cfg)],
        check=True,
        capture_output=True,
        text=True,
    )
    got = sorted(
        int(size) for code, size in (ln.split() for ln in proc.stdout.splitlines()) if code == "206"
    )
    if got != sorted(r.end - r.start for r in ranges):
        raise SystemExit(f"curl: only {len(got)}/{len(ranges)} transfers were exact 206 answers")


def check_curl_bytes(served: Served, layer: int, ids: list[int], out_dir: Path) -> None:
    """The baseline fetched the right bytes: each expert's files joined hash to the manifest."""
    i = 0
    for e in ids:
        entry = served.manifest.expert(layer, e)
        h = xxhash.xxh3_128()
        for _ in entry.ranges:
            h.update((out_dir / str(i)).read_bytes())
            i += 1
        if h.digest() != entry.xxh3:
            raise SystemExit(f"curl: layer {layer} expert {e} bytes do not match the manifest")


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def fsync_files(out_dir: Path) -> None:
    # The daemon's own call (F_FULLFSYNC on macOS), so curl pays what the daemon pays.
    for f in out_dir.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            full_fsync(fd)
        finally:
            os.close(fd)
    sync_dir(out_dir)


def measure(served: Served, *, ids: list[int], rounds: int, parallel: int) -> ColdResult:
    m = served.manifest
    layer = m.moe_layers[0]
    entries = [m.expert(layer, e) for e in ids]
    nbytes = sum(e.nbytes for e in entries)
    bufs = [np.ones(e.nbytes, np.uint8) for e in entries]
    hub_pid = served.hub.proc.pid
    cpu: dict[str, list[float]] = {k: [] for k in ("ours_daemon", "ours_hub", "curl", "curl_hub")}
    synced: list[float] = []
    sent: list[int] = []

    def ours() -> float:
        d = served.daemon()
        try:
            with d.client() as client:
                os.sync()
                pid = d.proc.pid if d.proc else 0
                c0, h0, t0 = proc_cpu_s(pid), proc_cpu_s(hub_pid), time.perf_counter()
                client.experts(served.repo, layer, ids, out=bufs)
                t = time.perf_counter() - t0
                cpu["ours_daemon"].append(proc_cpu_s(pid) - c0)
                cpu["ours_hub"].append(proc_cpu_s(hub_pid) - h0)
                stats = client.stats()
                if stats["counters"].get("fetched_experts") != len(ids):
                    raise SystemExit("ours: the daemon did not fetch every expert cold")
                up = stats["upstream"]  # Range GETs, or xorb GETs where the hub serves Xet
                sent[:] = [int(up.get("requests_range", 0) + up.get("requests_xet_xorb", 0))]
        finally:
            served.drop(d)
        return t

    def curl() -> float:
        out_dir = Path(tempfile.mkdtemp(prefix="curl-", dir=served.work))
        try:
            os.sync()
            c0, h0, t0 = children_cpu_s(), proc_cpu_s(hub_pid), time.perf_counter()
            curl_fetch(served, layer, ids, out_dir, parallel)
            t = time.perf_counter() - t0
            cpu["curl"].append(children_cpu_s() - c0)
            cpu["curl_hub"].append(proc_cpu_s(hub_pid) - h0)
            fsync_files(out_dir)
            synced.append(time.perf_counter() - t0)
            if len(synced) == 1:
                check_curl_bytes(served, layer, ids, out_dir)
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        return t

    def mbs(k: str, t: float) -> str:
        return f"{k}={nbytes / t / 1e6:.0f}MB/s"

    times = alternate({"ours": ours, "curl": curl}, rounds, mbs)
    del synced[0]  # the warm-up round
    for v in cpu.values():
        del v[0]
    # The last daemon round delivered the manifest's bytes.
    for e, buf in zip(entries, bufs, strict=True):
        if xxhash.xxh3_128(buf).digest() != e.xxh3:
            raise SystemExit(f"ours: expert {e.expert} bytes do not match the manifest")
    return ColdResult(
        nbytes / median(times["ours"]) / 1e6,
        nbytes / median(times["curl"]) / 1e6,
        nbytes,
        sent[0],
        nbytes / median(synced) / 1e6,
        {k: median(v) for k, v in cpu.items()},
        paired_ratio(times["curl"], times["ours"]),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, rounds=7)
    ap.add_argument("--experts", type=int, default=32, help="experts per layer in the checkpoint")
    ap.add_argument("--layers", type=int, default=3, help="model layers (the first is dense)")
    ap.add_argument("--ids", type=int, default=16, help="experts in the one cold call")
    ap.add_argument(
        "--pick",
        choices=["random", "first"],
        default="random",
        help="random ids (seeded) like a router, or the first N (all neighbours)",
    )
    ap.add_argument(
        "--parallel",
        type=int,
        default=constants.MAX_PARALLEL_FETCHES,
        help="curl transfers at once (the daemon's default upstream limit)",
    )
    args = ap.parse_args(argv)
    opts: dict[str, Any] = dict(
        experts=args.experts,
        layers=args.layers,
        shard_bytes=4 << 30,
        top_k=min(4, args.experts),
        **K3_SHAPE,
    )
    with served_checkpoint(args.dir, REPO, **opts) as served:
        ids = pick_ids(served, args.ids, args.pick)
        res = measure(served, ids=ids, rounds=args.rounds, parallel=args.parallel)
    print(
        f"cold: {len(ids)} experts ({args.pick}: {ids}), {res.nbytes} bytes, daemon sent "
        f"{res.upstream_requests} ranged GETs, curl {len(ids)} transfers at "
        f"{args.parallel} in parallel, rounds={args.rounds}"
    )
    print(
        f"ours (fresh daemon, verified + cached) MB/s={res.ours_mbs:.0f}   "
        f"curl (same ranges, to files) MB/s={res.curl_mbs:.0f}"
    )
    print(
        f"info: curl then fsync of its files MB/s={res.curl_fsync_mbs:.0f} (the daemon fsyncs "
        "every blob after its answer, outside the clock; curl does not fsync)"
    )
    c = res.cpu_s
    print(
        f"info: CPU s a round: ours daemon={c['ours_daemon']:.2f} hub={c['ours_hub']:.2f}   "
        f"curl={c['curl']:.2f} hub={c['curl_hub']:.2f}   (2 cores shared by all)"
    )
    print(f"info: median of per-round ratios={res.paired:.3f}")
    print(f"ratio={res.ratio:.3f}")


if __name__ == "__main__":
    main()
