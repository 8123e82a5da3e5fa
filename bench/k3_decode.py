"""Decode at K3's real expert size: the engine through a daemon vs the resident mlx-lm model,
with each streamed token's time split up.

A checkpoint with K3's real expert shapes (17,547,264 bytes an expert) and several MoE layers is
served by ``cachecd hub serve`` and installed with ``cachecd setup --stream``; every expert is
cached on disk (warm disk cache, page cache hot). In one process, alternating rounds, the same
greedy decode (a short prompt, then one ``mx.eval`` per token) runs on:
  resident: ``mlx_lm.utils.load_model(checkpoint)``, every weight in memory;
  ahead:    ``cachecd_engine.run.load`` through the daemon, RAM tier ``--ram`` (smaller than
            the experts the decode uses), read-ahead on (the default);
  no-ahead: the same with read-ahead off.
All must emit the same tokens. Activations are ``--dtype`` (float32 by default: MLX's CPU
quantized matmul is ~10x slower in bf16; experts stay mxfp4 either way).

Per streamed token it prints: blocked in routing read-backs (MLX runs the previous layer's
experts and this layer's attention during them, so this holds the compute), waiting for experts
(the part of getting them into the stack not hidden behind compute), remap/plan/array views, the
rest (graph building, the final eval); bytes read and copied; the guess's recall. The exposed
wait is compared with the raw read time of the same bytes: parallel ``preadv`` of page-cached
blobs, measured in this process. The last line is ratio = streamed (ahead) / resident tok/s.

    python bench/k3_decode.py [--experts 64] [--layers 6] [--tokens 8] [--rounds 3]
                              [--ram 1GiB] [--dtype float32|bfloat16] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
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
PROMPT = [11, 22, 33, 44]  # 4 tokens x top-16 = 64 rows: one sorted call per layer


@dataclass
class Case:
    model: Any
    tps: list[float] = field(default_factory=list)
    per_token: dict[str, list[float]] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)


def decode(model: Any, n: int) -> tuple[list[float], list[int], list[dict[str, float]]]:
    """Greedy decode of ``n`` tokens after PROMPT: per-token seconds, tokens, bank stats."""
    cache = model.make_cache()
    logits = model(mx.array(PROMPT)[None], cache=cache)
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


def runner(case: Case, n: int) -> Callable[[], float]:
    def run() -> float:
        times, toks, stats = decode(case.model, n)
        if case.tokens and toks != case.tokens:
            raise SystemExit("the same greedy decode emitted different tokens across rounds")
        case.tokens = toks
        case.tps.append(n / sum(times))
        for t, s in zip(times, stats, strict=True):
            case.per_token.setdefault("s", []).append(t)
            for k, v in s.items():
                case.per_token.setdefault(k, []).append(v)
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


def report(cases: dict[str, Case], rate: float, recall: float) -> None:
    ref = median(cases["resident"].tps)
    for name, c in cases.items():
        print(f"{name:9s} tok/s={median(c.tps):.3f} (x{median(c.tps) / ref:.3f}) "
              f"s/token={1 / median(c.tps):.3f}")
    for name in ("ahead", "no-ahead"):
        s = {k: median(v) for k, v in cases[name].per_token.items()}
        other = s["s"] - s["readback_s"] - s["wait_s"] - s["plan_s"]
        raw = s["source_bytes"] / rate
        print(
            f"{name:9s} per token: {s['s'] * 1e3:.0f} ms = read-backs (incl. compute) "
            f"{s['readback_s'] * 1e3:.0f} + expert wait {s['wait_s'] * 1e3:.1f} + plan/views "
            f"{s['plan_s'] * 1e3:.1f} + rest {other * 1e3:.0f} ms (resident token "
            f"{1e3 / ref:.0f} ms)"
        )
        print(
            f"{name:9s} experts/token: {s['experts_routed']:.0f} routed, {s['ram_hits']:.1f} RAM "
            f"tier, {s['staged_hits']:.1f} read ahead (of {s['staged']:.1f}), "
            f"{s['source_hits']:.1f} read on demand; read {s['source_bytes'] / 1e6:.0f} MB, "
            f"copied {(s['source_bytes'] + s['copied_bytes']) / 1e6:.0f} MB into memory"
        )
        print(
            f"{name:9s} exposed wait {s['wait_s'] * 1e3:.1f} ms vs raw read of the bytes read "
            f"{raw * 1e3:.1f} ms (x{s['wait_s'] / raw if raw else 0:.2f})"
        )
    print(f"info: raw parallel preadv {rate / GIB:.2f} GiB/s; next-layer guess recall "
          f"{recall:.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, rounds=3)
    ap.add_argument("--experts", type=int, default=64, help="experts per MoE layer")
    ap.add_argument("--layers", type=int, default=6, help="model layers (the first is dense)")
    ap.add_argument("--tokens", type=int, default=8, help="greedy decode steps a round")
    ap.add_argument("--ram", default="1GiB", help="RAM tier of the streamed models")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--tiny-experts", action="store_true",
                    help="the tiny model's 6.5 KB experts (for the smoke test; says nothing of K3)")
    args = ap.parse_args(argv)
    from cachecd_engine.run import load

    shape = {} if args.tiny_experts else K3_SHAPE
    opts: dict[str, Any] = dict(experts=args.experts, layers=args.layers, top_k=args.top_k,
                                shard_bytes=4_000_000_000, **shape)
    dtype = getattr(mx, args.dtype)
    with served_checkpoint(args.dir, REPO, **opts) as served:
        with installed(served) as (sock, cache_dir):
            warm_disk(sock, served)
            rate = raw_rate(served, cache_dir, readers=4)
            resident, _ = load_model(served.repo_dir)
            ram = parse_size(args.ram, "--ram")
            ahead, _ = load(served.repo, sock, ram_bytes=ram, prefetch=True)
            no_ahead, _ = load(served.repo, sock, ram_bytes=ram, prefetch=False)
            for model in (resident, ahead, no_ahead):
                model.set_dtype(dtype)
            cases = {"resident": Case(resident), "ahead": Case(ahead), "no-ahead": Case(no_ahead)}
            alternate({k: runner(c, args.tokens) for k, c in cases.items()}, args.rounds,
                      lambda k, v: f"{k}={v:.3f}tok/s")
            recall = ahead.prefetcher.recall
            for m in (ahead, no_ahead):
                m.bank.close()
                m.bank.source.close()
    for c in cases.values():  # drop the warm-up round
        del c.tps[0]
        for values in c.per_token.values():
            del values[: args.tokens]
    if len({tuple(c.tokens) for c in cases.values()}) != 1:
        raise SystemExit("streamed and resident greedy decodes emitted different tokens")
    print(f"k3_decode: {args.layers - 1} MoE layers x {args.experts} experts of "
          f"{int(served.manifest.sizes[0])} B, top-{args.top_k}, {args.tokens} tokens a round, "
          f"rounds={args.rounds}, activations {args.dtype}, RAM tier {args.ram}; same tokens "
          f"from all three")
    report(cases, rate, recall)
    print(f"ratio={median(cases['ahead'].tps) / median(cases['resident'].tps):.3f}")


if __name__ == "__main__":
    main()
