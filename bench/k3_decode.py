"""Decode at K3's real expert size: the engine through a daemon vs the resident mlx-lm model,
with each streamed token's time split up and its bytes counted.

A checkpoint with K3's real expert shapes (17,547,264 bytes an expert) is served by
``cachecd hub serve`` and installed with ``cachecd setup --stream``; every expert is cached on
disk (warm disk cache, page cache hot). In one process, in rounds whose order changes, the same
greedy decode (a 4-token prompt that differs every round, so the routing does too, then one
``mx.eval`` per token) runs on:
  resident:  ``mlx_lm.utils.load_model(checkpoint)``, every weight in memory;
  ram:       the engine with a pool of slots holding every expert (loaded before the rounds),
             a routing read-back per MoE layer;
  ram-spec:  the same, decode steps on the device map (no per-layer read-back when all hit);
  pc:        a pool of ``--small`` (smaller than the experts the rounds route to), the page
             cache behind it, per-layer read-backs, no read-ahead;
  pc-ahead:  the same with next-layer read-ahead;
  pc-spec:   the same as pc with speculative steps (what a miss costs when one is tried);
  pc-hostwrite: pc with misses written into slots from the host, as on unified memory (on
             CUDA the engine reads them into pinned memory and copies them to the GPU:
             ``cachecd_engine.pool.cuda_memory``; elsewhere pc-hostwrite is pc).
  pc-expertcopy: pc with each miss copied to the GPU once the whole expert has landed, not
             window by window as it lands (the engine before; on CUDA only, elsewhere it is pc).
  pc-defer:  pc with each layer's misses read while the model's thread builds the graph up to
             the next MoE layer (``ExpertBank.defer_reads``, off by default).
  pc-nocheck: pc with the check of every expert read against its xxh3-128 off
             (``DaemonSource.verify``; on in every other case, as by default): pc / pc-nocheck
             is what the check costs a token (issue 48).
With ``--throttle R`` every streamed case reads through one simulated disk of R GB/s
(``Throttled``: each read, demand or read-ahead, holds the disk for its bytes / R, in arrival
order; the page cache serves the bytes): a Mac's SSD beside this machine's compute.
Every case must emit the resident model's tokens. Activations are ``--dtype`` (float32 by
default: MLX's CPU quantized matmul is ~10x slower in bf16; experts stay mxfp4 either way).

Per streamed token, each part counted where it happens, it prints distributions over every
streamed token (median [p10, p90]; never medians of parts added and subtracted): the token's
seconds and the resident model's same token (same round and position, so the two pair); blocked
in routing read-backs (which run the compute queued before them); queued readers evaluated (a
claim about to refill slots that queued calls read evaluates them first: earlier calls' compute,
e.g. the previous group's); expert wait (only waits for expert bytes: demand reads, read-ahead a
call needs, derived arrays); the bank's own host work (the slot table and its policy, indices,
building the call); bytes needed (experts read on demand and read-ahead that was used), read
(read-ahead never used included) and written into memory by the host (the bytes ``preadv``
returned, derived arrays, resizes; a hit writes none); host overhead = token - resident token
- expert wait (what the engine adds beyond compute and I/O), and its share of the token; for
the pc cases the bar of issue 25: token / (raw read time of the needed bytes + resident token),
the raw read time measured here as parallel ``preadv`` of page-cached blobs into touched
buffers. The last line is ratio = (ram case the backend runs by default) / resident tok/s.

    python bench/k3_decode.py [--experts 64] [--layers 6] [--top-k 16] [--tokens 8]
        [--rounds 3] [--small 1GiB] [--dtype float32|bfloat16] [--cases resident,ram,...]
        [--throttle GB/s] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
    served_checkpoint,
    touched_buffers,
    warm_disk,
)
from mlx_lm.utils import load_model

from cachecd.config import parse_size
from cachecd_client.transport import parallel_preadv

REPO = "bench/k3-decode"
CASES = ("resident", "ram", "ram-spec", "pc", "pc-ahead", "pc-spec", "pc-hostwrite",
         "pc-expertcopy", "pc-defer", "pc-nocheck")
ENGINE = {  # pool, read-ahead, speculative steps
    "ram": ("all", False, False),
    "ram-spec": ("all", False, True),
    "pc": ("small", False, False),
    "pc-ahead": ("small", True, False),
    "pc-spec": ("small", False, True),
    "pc-hostwrite": ("small", False, False),
    "pc-expertcopy": ("small", False, False),
    "pc-defer": ("small", False, False),
    "pc-nocheck": ("small", False, False),
}
STATS = ("readback_s", "readers_s", "wait_s", "plan_s", "source_bytes", "copied_bytes", "experts_routed",
         "ram_hits", "staged_hits", "source_hits", "staged")


@dataclass
class Case:
    model: Any
    tps: list[float] = field(default_factory=list)
    per_token: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)  # round -> tokens
    calls: int = 0


def vocab_size(repo_dir: Path) -> int:
    config = json.loads((repo_dir / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def prompt_of(round_: int, vocab: int) -> list[int]:
    return np.random.default_rng(1000 + round_).integers(0, vocab, size=4).tolist()


def decode(model: Any, prompt: list[int], n: int) -> tuple[list[float], list[int], list[dict]]:
    """Greedy decode of ``n`` tokens after ``prompt``: per-token seconds, tokens, bank stats."""
    cache = model.make_cache()
    logits = model(mx.array(prompt)[None], cache=cache)
    mx.eval(logits)
    bank = getattr(model, "bank", None)
    times, toks, stats = [], [], []
    for _ in range(n):
        if bank is not None:
            bank.stats.reset()
        t0 = time.perf_counter()
        tok = mx.argmax(logits[:, -1], axis=-1)
        logits = model(tok[:, None], cache=cache)
        mx.eval(logits)
        times.append(time.perf_counter() - t0)
        toks.append(int(tok.item()))
        stats.append(bank.stats.snapshot() if bank is not None else {})
    return times, toks, stats


def runner(case: Case, n: int, vocab: int) -> Callable[[], float]:
    def run() -> float:
        r = case.calls  # call 0 is the warm-up round
        case.calls += 1
        times, toks, stats = decode(case.model, prompt_of(r, vocab), n)
        case.tokens[r] = toks
        if r == 0:
            return n / sum(times)
        case.tps.append(n / sum(times))
        for t, s in zip(times, stats, strict=True):
            case.per_token.setdefault("s", []).append(t)
            for k in STATS:
                case.per_token.setdefault(k, []).append(s.get(k, 0.0))
        return n / sum(times)

    return run


def raw_rate(served: Served, cache_dir: Path, readers: int) -> float:
    """Bytes/s of parallel preadv of one layer's 16 page-cached blobs (the raw read rate)."""
    m = served.manifest
    layer, ids = m.moe_layers[0], list(range(min(16, m.experts_per_layer)))
    paths = served.blob_paths(cache_dir, layer, ids)
    sizes = [m.expert(layer, e).nbytes for e in ids]
    views = [memoryview(b) for b in touched_buffers(len(ids), max(sizes))]
    times = []
    with ThreadPoolExecutor(readers) as pool:
        for _ in range(6):
            fds = open_all(paths)
            t0 = time.perf_counter()
            parallel_preadv(pool, fds, sizes, views)
            times.append(time.perf_counter() - t0)
            close_all(fds)
    return sum(sizes) / median(times[1:])


class Throttled:
    """An expert source behind one disk of ``rate`` bytes/s: each read holds the disk for its
    bytes / rate after the reads before it (demand and read-ahead alike), then returns."""

    def __init__(self, source: Any, rate: float) -> None:
        self.source, self.rate = source, rate
        self._lock = threading.Lock()
        self._free_at = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def _hold(self, targets: Any) -> float:
        n = sum(v.nbytes for t in targets for v in ([t] if isinstance(t, memoryview) else t))
        with self._lock:
            self._free_at = max(time.perf_counter(), self._free_at) + n / self.rate
            return self._free_at

    def read_into(self, layer: int, ids: list[int], targets: Any, landed: Any = None) -> int:
        until = self._hold(targets)
        got = int(self.source.read_into(layer, ids, targets, landed))
        time.sleep(max(0.0, until - time.perf_counter()))
        return got

    def read_ahead_into(self, layer: int, ids: list[int], targets: Any) -> int:
        until = self._hold(targets)
        got = int(self.source.read_ahead_into(layer, ids, targets))
        time.sleep(max(0.0, until - time.perf_counter()))
        return got


def fill_pool(model: Any, served: Served) -> None:
    """Every expert into the pool, a layer at a time."""
    m = served.manifest
    for layer in m.moe_layers:
        model.bank.acquire(layer, list(range(m.experts_per_layer)))
    model.bank.settle()


def load_case(name: str, served: Served, sock: Path, small: int, dtype: Any,
              throttle: float = 0.0) -> Any:
    from cachecd_engine.pool import cuda_memory
    from cachecd_engine.run import load

    if name == "resident":
        model, _ = load_model(served.repo_dir)
    else:
        pool, ahead, spec = ENGINE[name]
        m = served.manifest
        size = int(m.sizes.max()) * m.n_experts + (1 << 20) if pool == "all" else small
        cuda_memory.USE = name != "pc-hostwrite"
        try:
            model, _ = load(served.repo, sock, ram_bytes=size, prefetch=ahead, speculate=spec)
        finally:
            cuda_memory.USE = True
        model.bank.defer_reads = name == "pc-defer"
        model.bank.source.verify = name != "pc-nocheck"
        copier = model.bank.fill.copier
        if copier is not None:
            copier.by_window = name != "pc-expertcopy"
        if pool == "all":
            fill_pool(model, served)
        if throttle:
            model.bank.source = Throttled(model.bank.source, throttle)
    model.set_dtype(dtype)
    return model


def spread(values: Sequence[float], scale: float = 1e3, fmt: str = ".2f") -> str:
    """Median [p10, p90] of per-token values (ms by default)."""
    p10, p50, p90 = np.percentile(np.asarray(values, dtype=np.float64) * scale, [10, 50, 90])
    return f"{p50:{fmt}} [{p10:{fmt}}, {p90:{fmt}}]"


def per_token(c: Case, resident: list[float], expert_bytes: int,
              rate: float) -> dict[str, list[float]]:
    """Each token's parts, counted where they happen, paired with the resident model's same
    token (same round, same position: the rounds' prompts and tokens are the same)."""
    t = {k: np.asarray(v, dtype=np.float64) for k, v in c.per_token.items()}
    res = np.asarray(resident, dtype=np.float64)
    needed = (t["source_hits"] + t["staged_hits"]) * expert_bytes  # demand + read ahead used
    out = {"s": t["s"], "resident": res, "readback_s": t["readback_s"],
           "readers_s": t["readers_s"], "wait_s": t["wait_s"], "plan_s": t["plan_s"],
           "rest": t["s"] - t["readback_s"] - t["readers_s"] - t["wait_s"] - t["plan_s"],
           "host": t["s"] - res - t["wait_s"], "needed": needed, "raw": needed / rate}
    out["host_share"] = out["host"] / t["s"]
    out["bar"] = t["s"] / (out["raw"] + res)
    return {k: v.tolist() for k, v in out.items()}


def report(cases: dict[str, Case], rate: float, expert_bytes: int) -> None:
    ref = median(cases["resident"].tps) if "resident" in cases else 0.0
    for name, c in cases.items():
        ratio = f" (x{median(c.tps) / ref:.3f})" if ref else ""
        print(f"{name:9s} tok/s={median(c.tps):.3f}{ratio} s/token={1 / median(c.tps):.4f}")
    print("per token, median [p10, p90] over every streamed token (ms unless said)")
    resident = cases["resident"].per_token["s"]
    for name, c in cases.items():
        if name == "resident":
            continue
        d, s = per_token(c, resident, expert_bytes, rate), c.per_token
        spec = getattr(c.model.bank.speculator, "kept", None)
        print(f"{name:9s} token {spread(d['s'])}; resident token {spread(d['resident'])}")
        print(f"{name:9s}   read-backs {spread(d['readback_s'])}, queued readers evaluated "
              f"{spread(d['readers_s'])}, expert wait {spread(d['wait_s'])}, bank host work "
              f"{spread(d['plan_s'])}, rest {spread(d['rest'])}")
        print(f"{name:9s}   experts: routed {spread(s['experts_routed'], 1, '.0f')}, in the "
              f"pool {spread(s['ram_hits'], 1, '.1f')}, read ahead and used "
              f"{spread(s['staged_hits'], 1, '.1f')} (read ahead {spread(s['staged'], 1, '.1f')})"
              f", read on demand {spread(s['source_hits'], 1, '.1f')}"
              + (f"; speculative steps kept {spec}, missed {c.model.bank.speculator.missed}"
                 if spec is not None else ""))
        unused = sum(s["source_bytes"]) - sum(d["needed"])
        print(f"{name:9s}   MB: needed {spread(d['needed'], 1e-6, '.1f')}, read "
              f"{spread(s['source_bytes'], 1e-6, '.1f')}, copied "
              f"{spread(s['copied_bytes'], 1e-6, '.1f')}; read ahead and never used "
              f"{max(0.0, unused) / 1e6:.1f} MB over {len(d['s'])} tokens")
        line = (f"{name:9s}   host overhead (token - resident token - expert wait) "
                f"{spread(d['host'])} = {spread(d['host_share'], 100, '.1f')} % of the token")
        if ENGINE[name][0] == "small":
            line += (f"; raw read of the needed bytes {spread(d['raw'])}; token / (raw read + "
                     f"resident token) {spread(d['bar'], 1)} (bar <= 1.3)")
        print(line)
    if "pc" in cases and "pc-nocheck" in cases:
        pc, off = cases["pc"], cases["pc-nocheck"]
        paired = median([a / b for a, b in zip(pc.tps, off.tps, strict=True)])
        print(f"check: pc / pc-nocheck tok/s={median(pc.tps) / median(off.tps):.3f} (median of "
              f"per-round ratios {paired:.3f}); expert wait a token "
              f"{spread(pc.per_token['wait_s'])} checked, {spread(off.per_token['wait_s'])} not")
    print(f"info: raw parallel preadv {rate / GIB:.2f} GiB/s")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, rounds=3)
    ap.add_argument("--experts", type=int, default=64, help="experts per MoE layer")
    ap.add_argument("--layers", type=int, default=6, help="model layers (the first is dense)")
    ap.add_argument("--tokens", type=int, default=8, help="greedy decode steps a round")
    ap.add_argument("--small", default="1GiB", help="the pool of the pc cases")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--cases", default=",".join(CASES), help="which cases, comma-separated")
    ap.add_argument("--throttle", type=float, default=0.0,
                    help="GB/s: read every streamed case's experts through a disk this fast")
    ap.add_argument("--tiny-experts", action="store_true",
                    help="the tiny model's 6.5 KB experts (for the smoke test; says nothing of K3)")
    args = ap.parse_args(argv)
    from cachecd_engine.pool.speculate import speculate_by_default

    names = [n for n in args.cases.split(",") if n]
    if "resident" not in names or set(names) - set(CASES):
        raise SystemExit(f"--cases: resident and any of {', '.join(CASES[1:])}")
    shape = {} if args.tiny_experts else K3_SHAPE
    opts: dict[str, Any] = dict(experts=args.experts, layers=args.layers, top_k=args.top_k,
                                shard_bytes=4_000_000_000, **shape)
    dtype = getattr(mx, args.dtype)
    small = parse_size(args.small, "--small")
    with served_checkpoint(args.dir, REPO, **opts) as served:
        with installed(served) as (sock, cache_dir):
            warm_disk(sock, served)
            # The bar's raw read: the throttled disk's rate where there is one.
            rate = args.throttle * 1e9 or raw_rate(served, cache_dir, readers=4)
            vocab = vocab_size(served.repo_dir)
            cases = {n: Case(load_case(n, served, sock, small, dtype, args.throttle * 1e9))
                     for n in names}
            alternate({k: runner(c, args.tokens, vocab) for k, c in cases.items()}, args.rounds,
                      lambda k, v: f"{k}={v:.3f}tok/s")
            for c in cases.values():
                bank = getattr(c.model, "bank", None)
                if bank is not None:
                    bank.close()
                    bank.source.close()
    want = cases["resident"].tokens
    if any(c.tokens != want for c in cases.values()):
        raise SystemExit("a streamed decode emitted other tokens than the resident model")
    m = served.manifest
    print(f"k3_decode: {args.layers - 1} MoE layers x {args.experts} experts of "
          f"{int(m.sizes[0])} B, top-{args.top_k}, {args.tokens} tokens a round, prompts that "
          f"differ by round, rounds={args.rounds}, activations {args.dtype}, pc pool "
          f"{args.small}, backend {mx.default_device()}"
          + (f", disk throttled to {args.throttle} GB/s" if args.throttle else "")
          + "; the same tokens from every case")
    report(cases, rate, int(m.sizes[0]))
    head = "ram-spec" if speculate_by_default() else "ram"
    if head in cases:
        print(f"ratio={median(cases[head].tps) / median(cases['resident'].tps):.3f}")
    else:
        print("ratio=0.000")


if __name__ == "__main__":
    main()
