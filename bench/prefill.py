"""Prefill at K3's real expert size: layer by layer vs step by step, with a pool of one layer's
experts and the page cache behind it, against the resident mlx-lm model.

A checkpoint with K3's real expert shapes (17,547,264 bytes an expert, bench/k3_decode.py's
helpers) is served by ``cachecd hub serve`` and installed with ``cachecd setup --stream``; every
expert is cached on disk (warm disk cache, page cache hot). One prompt of ``--tokens`` tokens is
prefilled through mlx-lm's own loop (``generate_step``, ``max_tokens=0``: the prompt's steps,
then the last token's) at each ``--steps`` size by:
  resident: ``mlx_lm.utils.load_model(checkpoint)``, every weight in memory;
  layers:   the engine, its pool one layer's experts (empty at the start), prefill layer by
            layer (``cachecd_engine.prefill_defer``, the default);
  steps:    the same, step by step (``load(layer_major=False)``: mlx-lm's order).
With ``--pool-layers F`` below 1 the pool holds F of a layer's experts (a small Mac's case):
  layers:   a layer's calls of every step taken together (``cachecd_engine.pool.chunks``: each
            group of experts read once for every step's rows);
  inturn:   layer by layer, each step's call in turn (the way before ``pool.chunks``).
Each streamed prefill's last logits must be the resident model's at the same step size, bitwise.
With ``--batched`` the prompt goes through mlx-lm's ``BatchGenerator`` instead (the path of
``batch_generate`` and of ``cachecd openai``'s batched requests; ``prefill_batch`` runs its steps
ahead layer by layer): TTFT is to the first generated token's logits.

Per step size and case it prints the time to first token (TTFT); the bytes read from the daemon
against one pass over the routed experts (each distinct routed expert of each layer once: the
bar is <= 1.05x whatever the step); the raw read time of those bytes (parallel ``preadv`` of
page-cached blobs, measured here); and TTFT / (raw read time + resident TTFT) (the bar on a GPU
is <= 1.3). The last line is ``ratio=`` that quotient for the layer-by-layer case at the largest
step. Activations are ``--dtype`` (float32 by default: MLX's CPU quantized matmul is ~10x slower
in bf16; experts stay mxfp4 either way).

    python bench/prefill.py [--tokens 8192] [--steps 2048,512] [--experts 64] [--layers 4]
        [--top-k 16] [--dtype float32|bfloat16] [--pool-layers 1.0] [--rounds 1] [--dir /tmp]
        [--batched]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import mlx.core as mx
import numpy as np
from _common import (
    GIB,
    K3_SHAPE,
    Served,
    add_common_args,
    installed,
    median,
    served_checkpoint,
    warm_disk,
)
from k3_decode import raw_rate, vocab_size
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

REPO = "bench/k3-prefill"
CASES = ("resident", "layers", "steps", "inturn")


def prefill(model: Any, prompt: list[int], step: int) -> tuple[float, np.ndarray]:
    """Seconds to the first token's logits through mlx-lm's loop, and those logits."""
    last: list[mx.array] = []

    def keep(tokens: mx.array, logits: mx.array) -> mx.array:
        last.append(logits)
        return logits

    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    for _ in generate_step(mx.array(prompt), model, max_tokens=0, prefill_step_size=step,
                           prompt_cache=cache, logits_processors=[keep]):
        pass
    took = time.perf_counter() - t0
    return took, np.array(last[-1].astype(mx.float32))


def prefill_batched(model: Any, prompt: list[int], step: int) -> tuple[float, np.ndarray]:
    """The same through mlx-lm's ``BatchGenerator``, the prompt alone in its batch."""
    first: list[mx.array] = []

    def keep(tokens: mx.array, logits: mx.array) -> mx.array:
        first.append(logits)
        return logits

    gen = BatchGenerator(model, max_tokens=1, prefill_step_size=step, logits_processors=[keep])
    gen.insert([prompt])
    t0 = time.perf_counter()
    while not first:
        gen.next()
    mx.eval(first[0])
    took = time.perf_counter() - t0
    gen.close()
    return took, np.array(first[0].astype(mx.float32))


def streamed(served: Served, sock: Any, name: str, dtype: Any, fraction: float) -> Any:
    """The engine with a pool of ``fraction`` of one layer's experts, nothing in it yet."""
    from cachecd_engine.run import load

    m = served.manifest
    slots = max(2, int(m.experts_per_layer * fraction))
    model, _ = load(served.repo, sock, ram_bytes=int(m.sizes.max()) * slots + 1, prefetch=False,
                    speculate=False, layer_major=name != "steps")
    assert model.bank.capacity == slots
    if name == "inturn":
        model.bank.groups_chunks = lambda: False
    model.set_dtype(dtype)
    return model


def run_case(served: Served, sock: Any, name: str, dtype: Any, prompt: list[int],
             step: int, fraction: float, batched: bool = False) -> dict[str, Any]:
    model = streamed(served, sock, name, dtype, fraction)
    routed: set[tuple[int, int]] = set()
    model.bank.trace = lambda layer, ids: routed.update((layer, int(e)) for e in np.unique(ids))
    try:
        took, logits = (prefill_batched if batched else prefill)(model, prompt, step)
        got = {"s": took, "logits": logits, "read": model.bank.stats.source_bytes,
               "pass": len(routed) * int(served.manifest.sizes.max()), "routed": len(routed),
               "wait_s": model.bank.stats.wait_s, "readback_s": model.bank.stats.readback_s}
    finally:
        model.bank.close()
        model.bank.source.close()
    return got


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, rounds=1)
    ap.add_argument("--tokens", type=int, default=8192, help="prompt tokens")
    ap.add_argument("--steps", default="2048,512", help="prefill step sizes, comma-separated")
    ap.add_argument("--experts", type=int, default=64, help="experts per MoE layer")
    ap.add_argument("--layers", type=int, default=4, help="model layers (the first is dense)")
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--pool-layers", type=float, default=1.0,
                    help="the pool, in layers' worth of experts (below 1: a small Mac's case)")
    ap.add_argument("--tiny-experts", action="store_true",
                    help="the tiny model's 6.5 KB experts (for the smoke test; says nothing of K3)")
    ap.add_argument("--batched", action="store_true",
                    help="through mlx-lm's BatchGenerator (batch_generate, cachecd openai)")
    args = ap.parse_args(argv)
    run = prefill_batched if args.batched else prefill
    steps = [int(s) for s in args.steps.split(",") if s]
    shape = {} if args.tiny_experts else K3_SHAPE
    opts: dict[str, Any] = dict(experts=args.experts, layers=args.layers, top_k=args.top_k,
                                shard_bytes=4_000_000_000, **shape)
    dtype = getattr(mx, args.dtype)
    cases = CASES[1:] if args.pool_layers < 1 else CASES[1:3]
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with served_checkpoint(args.dir, REPO, **opts) as served:
        with installed(served) as (sock, cache_dir):
            warm_disk(sock, served)
            rate = raw_rate(served, cache_dir, readers=4)
            prompt = np.random.default_rng(7).integers(
                0, vocab_size(served.repo_dir), size=args.tokens).tolist()
            resident, _ = load_model(served.repo_dir)
            resident.set_dtype(dtype)
            for step in steps:  # untimed: the first call in a process compiles the GPU's
                run(resident, prompt, step)  # kernels (77 s against 5 s warm on the H100)
            for _ in range(args.rounds):
                for step in steps:
                    took, logits = run(resident, prompt, step)
                    results.setdefault(("resident", step), []).append({"s": took,
                                                                       "logits": logits})
                    for name in cases:
                        got = run_case(served, sock, name, dtype, prompt, step,
                                       args.pool_layers, args.batched)
                        results.setdefault((name, step), []).append(got)
                        if not np.array_equal(got["logits"].view(np.uint32),
                                              logits.view(np.uint32)):
                            raise SystemExit(f"{name} at step {step}: logits differ from "
                                             f"the resident model's")
                        print(f"round: {name} step {step} TTFT {got['s']:.2f} s", flush=True)
    m = served.manifest
    print(f"prefill: {args.layers - 1} MoE layers x {args.experts} experts of "
          f"{int(m.sizes[0])} B, top-{args.top_k}, a prompt of {args.tokens} tokens, pool of "
          f"{args.pool_layers:g} layer's experts ({max(2, int(args.experts * args.pool_layers))}"
          f" slots), page cache behind it, activations "
          f"{args.dtype}, backend {mx.default_device()}, rounds={args.rounds}, "
          f"{'BatchGenerator' if args.batched else 'generate_step'}; every streamed "
          f"prefill's logits bitwise the resident model's at its step size")
    print(f"info: raw parallel preadv {rate / GIB:.2f} GiB/s")
    ratio = report(results, steps, rate, cases)
    print(f"ratio={ratio:.3f}")


def report(results: dict[tuple[str, int], list[dict[str, Any]]], steps: list[int],
           rate: float, cases: tuple[str, ...]) -> float:
    """Print each case's figures; return the layer-by-layer bar at the largest step."""
    bar_at: dict[int, float] = {}
    for step in steps:
        res_s = median([r["s"] for r in results[("resident", step)]])
        print(f"step {step:5d} resident TTFT {res_s:.2f} s")
        for name in cases:
            rs = results[(name, step)]
            took, read = median([r["s"] for r in rs]), rs[-1]["read"]
            # One pass: every expert the prompt routes to at this step (step by step computes
            # them all; layer by layer skips what nothing reads, see prefill.py).
            one = results[("steps", step)][-1]["pass"]
            routed = results[("steps", step)][-1]["routed"]
            raw = read / rate
            bar = took / (raw + res_s)
            bar_at[step] = bar if name == "layers" else bar_at.get(step, 0.0)
            print(f"step {step:5d} {name:8s} TTFT {took:.2f} s; read {read / 1e6:.0f} MB = "
                  f"{read / one:.2f}x one pass over the {routed} routed experts "
                  f"({one / 1e6:.0f} MB); raw read {raw:.2f} s; TTFT / (raw read + resident) "
                  f"= {bar:.2f}; expert wait {rs[-1]['wait_s']:.2f} s, routing read-backs "
                  f"(the compute queued before them) {rs[-1]['readback_s']:.2f} s")
    return bar_at[max(steps)]


if __name__ == "__main__":
    main()
