"""A long generation of the tiny model through a daemon vs the resident mlx-lm model: where the
per-token cost of the engine, not compute, sets the pace.

The tiny K3 (7 layers, 48 experts, top-4; 6.5 KB experts) is served by ``cachecd hub serve`` and
installed with ``cachecd setup --stream``; every expert is cached on disk first. Then
``mlx_lm.stream_generate`` makes ``--tokens`` tokens (greedy, EOS ignored) from the same prompt
with:
  resident: ``mlx_lm.utils.load_model(checkpoint)``;
  streamed: ``cachecd_engine.run.load`` through the daemon with a pool of ``--pool`` (default 64
            KiB: 10 of the 288 experts, so most layer calls read from the daemon), read-ahead and
            speculative steps at the backend's defaults.
Both must emit the same tokens. Prints each one's seconds and tok/s, alternating rounds; the last
line is ratio = streamed / resident tok/s. Run it on each machine to compare the two (issue 25:
the streamed run on a GPU must not be slower than on two CPU cores).

    python bench/tiny_generate.py [--tokens 1000] [--rounds 3] [--pool 64KiB] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import mlx.core as mx
from _common import add_common_args, alternate, installed, median, served_checkpoint, warm_disk
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model

from cachecd.config import parse_size

REPO = "bench/tiny-generate"
PROMPT = "Experts stream from the hub into a verified cache, layer after layer."


def generate(model: Any, tokenizer: Any, n: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    toks = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=n,
                                             sampler=make_sampler(temp=0.0))]
    return time.perf_counter() - t0, toks


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, rounds=3)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--pool", default="64KiB", help="the streamed model's pool of expert slots")
    args = ap.parse_args(argv)
    from cachecd_engine.run import load

    with served_checkpoint(args.dir, REPO, experts=48, layers=7, top_k=4) as served:
        with installed(served) as (sock, _):
            warm_disk(sock, served)
            resident, _ = load_model(served.repo_dir)
            streamed, tokenizer = load(served.repo, sock,
                                       ram_bytes=parse_size(args.pool, "--pool"))
            tokenizer.eos_token_ids = set()  # random weights: never stop early
            seen: dict[str, list[int]] = {}
            secs: dict[str, list[float]] = {"resident": [], "streamed": []}

            def case(name: str, model: Any) -> Any:
                def run() -> float:
                    s, toks = generate(model, tokenizer, args.tokens)
                    if seen.setdefault(name, toks) != toks or len(toks) != args.tokens:
                        raise SystemExit(f"{name}: another sequence than before")
                    secs[name].append(s)
                    return args.tokens / s
                return run

            alternate({"resident": case("resident", resident),
                       "streamed": case("streamed", streamed)}, args.rounds,
                      lambda k, v: f"{k}={v:.1f}tok/s")
            bank = streamed.bank
            spec = bank.speculator
            calls = 2 * args.tokens  # the warm-up round and the measured one (rounds=1)
            per = {k: v / max(1, calls) for k, v in bank.stats.snapshot().items()}
            bank.close()
            bank.source.close()
    if seen["resident"] != seen["streamed"]:
        raise SystemExit("streamed and resident generations differ")
    res, ours = median(secs["resident"][1:]), median(secs["streamed"][1:])
    print(f"tiny_generate: {args.tokens} tokens, 7 layers x 48 experts, top-4, pool {args.pool} "
          f"({bank.capacity} slots), backend {mx.default_device()}, rounds={args.rounds}; the "
          f"same tokens")
    print(f"resident {res:.2f} s ({args.tokens / res:.1f} tok/s); streamed {ours:.2f} s "
          f"({args.tokens / ours:.1f} tok/s)"
          + (f"; speculative steps kept {spec.kept}, missed {spec.missed}" if spec else ""))
    print(f"info: streamed per token over all rounds: read-backs {per['readback_s'] * 1e3:.2f} ms, "
          f"expert wait {per['wait_s'] * 1e3:.2f} ms, bank host work {per['plan_s'] * 1e3:.2f} "
          f"ms, {per['source_hits']:.1f} experts read, {per['ram_hits']:.1f} pool hits, "
          f"{per['layer_calls']:.1f} layer calls, {per['groups']:.1f} kernel calls")
    print(f"ratio={res / ours:.3f}")


if __name__ == "__main__":
    main()
