"""Concurrent streams through ``cachecd openai``'s batching: aggregate tok/s and bytes read per
generated token at 1, 2, 4 and 8 streams, with a pool smaller than the working set.

``cachecd openai`` runs the requests in flight through mlx-lm's ``BatchGenerator`` (one forward
pass for all of them a step), over the model ``cachecd_engine.load`` gives it; this bench does
the same in-process. A checkpoint with K3's real expert shapes (bench/k3_decode.py's; or the
tiny model's experts with ``--tiny-experts``) is served by ``cachecd hub serve`` and installed
with ``cachecd setup --stream``; every expert is on disk (the page cache behind it). For each
stream count B, B prompts of ``--prompt`` random tokens are inserted at once, and each generates
``--tokens`` greedy tokens:
  streamed: the engine (``cachecd_engine.run.load``, the defaults of ``cachecd openai``), its
            pool ``--pool-layers`` layers' experts (1: one layer's, of ``--layers - 1`` MoE
            layers), loaded fresh for each B;
  resident: ``mlx_lm.utils.load_model(checkpoint)``, every weight in memory, the same batches.
Measured over the decode steps (from the step after the prefill's first tokens to the last):
aggregate tok/s, bytes the engine read from the daemon per generated token, experts read per
generated token, and the read per token against one stream's; and, whatever the pool holds, the
distinct experts a step's layer calls route to per (token, expert) pair: what a token added to
the batch costs in expert reads against a lone token (the published K3 figure for context, for
the tokens of one chunk: 0.39x at 8 tokens, 0.24x at 32). A random router spreads tokens evenly
over the experts, where a trained one favours some: ``--skew S`` biases each MoE layer's router
toward a random order of its experts (``e_score_correction_bias`` = -S x log(1 + rank), before
the manifest is built; 0, the default, leaves the random router). Each stream's tokens are
compared with the resident model's (``same=``).

The last line is one parsable summary: ``batching streams=1,2,4,8 tok_s=... resident_tok_s=...
ratio=... bytes_per_token=... read_vs_one=... routed_share=...`` (comma-separated, in stream
order).

    python bench/batching.py [--streams 1,2,4,8] [--experts 64] [--layers 4] [--top-k 8]
        [--prompt 32] [--tokens 32] [--pool-layers 1] [--skew 0] [--dtype float32|bfloat16]
        [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import struct
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from _common import K3_SHAPE, Served, add_common_args, installed, served_checkpoint, warm_disk
from k3_decode import vocab_size
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load_model

REPO = "bench/k3-batching"


def generate(model: Any, prompts: list[list[int]], tokens: int,
             read: Any = lambda: (0, 0, 0, 0)) -> dict[str, Any]:
    """mlx-lm's batching over ``prompts`` (all inserted at once, as requests arriving together):
    each stream's tokens, and the decode steps' seconds, tokens and counters (``read()``: bytes
    and experts read, experts routed and rows so far)."""
    gen = BatchGenerator(model, max_tokens=tokens, completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts))
    uids = gen.insert(prompts, [tokens] * len(prompts))
    out: dict[int, list[int]] = {u: [] for u in uids}
    left, start = set(uids), None
    while left:
        responses = gen.next_generated()
        if start is None:  # the prefill's tokens: decode starts after them
            mx.synchronize()
            start = (time.perf_counter(), read(), sum(map(len, out.values())) + len(responses))
        for r in responses:
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                left.discard(r.uid)
    mx.synchronize()
    t1, end = time.perf_counter(), read()
    gen.close()
    assert start is not None
    t0, begin, n0 = start
    n = sum(map(len, out.values())) - n0
    bytes_, experts, routed, rows = (b - a for a, b in zip(begin, end, strict=True))
    return {"tokens": [out[u] for u in uids], "s": t1 - t0, "n": n, "bytes": bytes_,
            "experts": experts, "share": routed / rows if rows else float("nan")}


def skew_routers(repo_dir: Path, skew: float, seed: int = 5) -> None:
    """Each MoE layer's router biased toward a random order of its experts, in place in the
    checkpoint's shards (``e_score_correction_bias``, float32)."""
    rng = np.random.default_rng(seed)
    for shard in sorted(repo_dir.glob("*.safetensors")):
        with open(shard, "r+b") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
            for name, t in sorted(header.items()):
                if not name.endswith("e_score_correction_bias"):
                    continue
                assert t["dtype"] == "F32", name
                a, b = t["data_offsets"]
                rank = rng.permutation((b - a) // 4)
                f.seek(8 + size + a)
                f.write((-skew * np.log1p(rank)).astype("<f4").tobytes())


def streamed(served: Served, sock: Any, pool_layers: float, dtype: Any) -> Any:
    from cachecd_engine.run import load

    m = served.manifest
    pool = int(pool_layers * m.experts_per_layer) * int(m.sizes.max()) + 1
    model, _ = load(served.repo, sock, ram_bytes=pool)
    model.set_dtype(dtype)
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, rounds=1)
    ap.add_argument("--streams", default="1,2,4,8", help="concurrent streams, comma-separated")
    ap.add_argument("--experts", type=int, default=64, help="experts per MoE layer")
    ap.add_argument("--layers", type=int, default=4, help="model layers (the first is dense)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens a stream")
    ap.add_argument("--tokens", type=int, default=32, help="tokens a stream generates")
    ap.add_argument("--pool-layers", type=float, default=1.0,
                    help="the engine's pool, in layers' worth of experts (default 1)")
    ap.add_argument("--skew", type=float, default=0.0,
                    help="bias each router toward some experts (0: the random router)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tiny-experts", action="store_true",
                    help="the tiny model's 6.5 KB experts (fast; says nothing of K3's sizes)")
    args = ap.parse_args(argv)
    counts = [int(s) for s in args.streams.split(",") if s]
    shape = {} if args.tiny_experts else K3_SHAPE
    dtype = getattr(mx, args.dtype)
    rows: list[dict[str, Any]] = []
    skew = (lambda d: skew_routers(d, args.skew)) if args.skew else None
    with served_checkpoint(args.dir, REPO, skew, experts=args.experts, layers=args.layers,
                           top_k=args.top_k, shard_bytes=4_000_000_000, **shape) as served:
        with installed(served) as (sock, _):
            warm_disk(sock, served)
            rng = np.random.default_rng(11)
            vocab = vocab_size(served.repo_dir)
            resident, _ = load_model(served.repo_dir)
            resident.set_dtype(dtype)
            for b in counts:
                prompts = rng.integers(0, vocab, size=(b, args.prompt)).tolist()
                ref = generate(resident, prompts, args.tokens)
                model = streamed(served, sock, args.pool_layers, dtype)
                s = model.bank.stats
                try:
                    got = generate(model, prompts, args.tokens, lambda s=s: (
                        s.source_bytes, s.source_hits + s.staged, s.experts_routed, s.rows))
                finally:
                    model.bank.close()
                    model.bank.source.close()
                got["same"] = got["tokens"] == ref["tokens"]
                got["resident_tok_s"] = ref["n"] / ref["s"]
                got["streams"] = b
                rows.append(got)
                print(f"round: {b} streams done", flush=True)
    report(served, args, rows)


def report(served: Served, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    m = served.manifest
    moe = len(m.moe_layers)
    print(f"batching: {moe} MoE layers x {args.experts} experts of {int(m.sizes[0])} B, "
          f"top-{args.top_k}, router skew {args.skew:g}, prompts of {args.prompt} tokens, "
          f"{args.tokens} tokens a stream, "
          f"pool {args.pool_layers:g} layer(s) of experts (working set: {moe} layers), page "
          f"cache behind it, activations {args.dtype}, backend {mx.default_device()}")
    one = rows[0]["bytes"] / rows[0]["n"]
    for r in rows:
        tok_s, per = r["n"] / r["s"], r["bytes"] / r["n"]
        r["tok_s"], r["per"], r["vs_one"] = tok_s, per, per / one if one else float("nan")
        print(f"streams {r['streams']}: streamed {tok_s:.2f} tok/s, resident "
              f"{r['resident_tok_s']:.2f} tok/s ({tok_s / r['resident_tok_s']:.2f}x); read "
              f"{per / 1e6:.2f} MB and {r['experts'] / r['n']:.1f} experts a generated token "
              f"({r['vs_one']:.2f}x one stream's); routed {r['share']:.2f} distinct experts a "
              f"(token, expert) pair; {r['n']} decode tokens in {r['s']:.2f} s; "
              f"same tokens as resident: {'yes' if r['same'] else 'NO'}")

    def col(key: str, fmt: str) -> str:
        return ",".join(format(r[key], fmt) for r in rows)

    ratio = ",".join(f"{r['tok_s'] / r['resident_tok_s']:.3f}" for r in rows)
    print(f"batching streams={col('streams', 'd')} tok_s={col('tok_s', '.2f')} "
          f"resident_tok_s={col('resident_tok_s', '.2f')} ratio={ratio} "
          f"bytes_per_token={col('per', '.0f')} read_vs_one={col('vs_one', '.3f')} "
          f"routed_share={col('share', '.3f')} "
          f"same={','.join('1' if r['same'] else '0' for r in rows)} dtype={args.dtype} "
          f"device={'gpu' if mx.default_device() == mx.gpu else 'cpu'}")


if __name__ == "__main__":
    main()
