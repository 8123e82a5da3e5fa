"""Decode tokens/s: streamed (warm RAM tier) vs the fully resident mlx-lm model, same process.

Writes the tiny K3 checkpoint to a temp dir, loads it twice (``mlx_lm.utils.load_model`` and the
streamed loader over a LocalSource), warms the RAM tier, then alternates rounds so both see the
same machine load. Prints each round and the ratio of medians (streamed / resident); the bar is
>= 0.9. Not a test: numbers depend on the machine.

    python bench/engine.py [--fmt mxfp4|fp32] [--rounds 7] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from cachecd_engine.loader import load
from cachecd_engine.local_source import LocalSource, manifest_from_dir
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model

from cachecd.tiny_model import write_tiny_model

PROMPT = "Once upon a time, in a land far away, a tiny model streamed its experts"


def decode_tps(model, prompt: mx.array, tokens: int) -> tuple[float, float]:
    """Greedy decode with one sync per token (the loop a simple caller writes).

    Returns (tokens/s by the wall clock, tokens per CPU second of this process); the second is
    less disturbed by other processes on a shared machine.
    """
    cache = model.make_cache()
    logits = model(prompt, cache=cache)
    mx.eval(logits)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(tokens):
        logits = model(mx.argmax(logits[:, -1], axis=-1)[:, None], cache=cache)
        mx.eval(logits)
    return tokens / (time.perf_counter() - t0), tokens / (time.process_time() - c0)


def generate_tps(model, tokenizer, tokens: int) -> float:
    """mlx-lm's own generation loop (async eval pipelining included), as a user runs it."""
    last = None
    for last in stream_generate(
        model, tokenizer, PROMPT, max_tokens=tokens, sampler=make_sampler(temp=0.0)
    ):
        pass
    assert last is not None
    return float(last.generation_tps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", default="mxfp4", choices=["mxfp4", "fp32"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cd-bench-engine-") as tmp:
        ckpt = write_tiny_model(Path(tmp) / "tiny", seed=0, fmt=args.fmt)
        resident, _ = load_model(ckpt)
        with LocalSource(manifest_from_dir(ckpt), ckpt, verify=False) as source:
            streamed, tokenizer = load(ckpt, source, ram_bytes=1 << 30)
            prompt = mx.array(tokenizer.encode(PROMPT))[None]
            for m in (resident, streamed):  # warm-up: kernels, and the RAM tier
                decode_tps(m, prompt, args.tokens)
                generate_tps(m, tokenizer, args.tokens)
            streamed.bank.stats.reset()
            keys = ("res_dec", "str_dec", "res_cpu", "str_cpu", "res_gen", "str_gen")
            rows: dict[str, list[float]] = {k: [] for k in keys}
            for r in range(args.rounds):
                for who, m in (("res", resident), ("str", streamed)):
                    wall, cpu = decode_tps(m, prompt, args.tokens)
                    rows[f"{who}_dec"].append(wall)
                    rows[f"{who}_cpu"].append(cpu)
                rows["res_gen"].append(generate_tps(resident, tokenizer, args.tokens))
                rows["str_gen"].append(generate_tps(streamed, tokenizer, args.tokens))
                print(f"round={r} " + " ".join(f"{k}={v[-1]:.1f}" for k, v in rows.items()))
            stats = streamed.bank.stats
            print(f"streamed ram_hits={stats.ram_hits} source_hits={stats.source_hits}")
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(
        f"fmt={args.fmt} decode tok/s: resident={med['res_dec']:.1f} streamed={med['str_dec']:.1f}"
        f" ratio={med['str_dec'] / med['res_dec']:.3f}"
    )
    print(
        f"fmt={args.fmt} decode tok per CPU-s: resident={med['res_cpu']:.1f}"
        f" streamed={med['str_cpu']:.1f} ratio={med['str_cpu'] / med['res_cpu']:.3f}"
    )
    print(
        f"fmt={args.fmt} stream_generate tok/s: resident={med['res_gen']:.1f}"
        f" streamed={med['str_gen']:.1f} ratio={med['str_gen'] / med['res_gen']:.3f}"
    )


if __name__ == "__main__":
    main()
