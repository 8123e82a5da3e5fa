"""``cachecd tiny-model``: a tiny random Kimi K3 (``tiny_model``) or Kimi K2 (``tiny_k2``)
checkpoint, written into OUT for tests, the demo and trying things out."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cachecd.errors import InvalidRequest


def register(sub: Any) -> None:
    p = sub.add_parser(
        "tiny-model",
        help="write a tiny random Kimi-K3 (or K2) checkpoint into OUT",
        description="Write a random Kimi-K3-architecture checkpoint in K3's on-disk layout "
        "(mlx-lm loads it unmodified); --format int4 or fp8 writes a DeepSeek-V3-layout Kimi K2 "
        "instead (K2-Thinking's int4 experts, K2-Instruct's fp8 experts).",
    )
    p.add_argument("out", type=Path, metavar="OUT", help="the folder to write the checkpoint into")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--experts", type=int, default=32, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=4, help="experts each token routes to")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (the first one dense)")
    p.add_argument("--shard-bytes", type=int, help="shard size (default: 256 KiB, K2: 96 KiB)")
    p.add_argument("--format", dest="fmt", choices=("mxfp4", "fp32", "int4", "fp8"),
                   default="mxfp4", help="mxfp4, fp32: K3; int4, fp8: K2 (DeepSeek-V3 layout)")
    p.add_argument("--expert-hidden", type=int, default=64, help="K3's expert latent width")
    p.add_argument("--moe-intermediate", type=int, default=64,
                   help="an expert's intermediate width")
    p.add_argument("--kimi-tokenizer", action="store_true",
                   help="Kimi's tokenizer form: tiktoken.model, remote code (tokenization_kimi.py, "
                        "needs --trust-remote-code to run), tokenizer_config.json with auto_map")
    p.add_argument("--multimodal", action="store_true",
                   help="K3: also a vision tower, a projector and an MTP layer, as K3's repo has "
                        "(mlx-lm's text model drops them)")
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    from cachecd.testbed.tiny_config import TinyOptions
    from cachecd.testbed.tiny_model import DEFAULT_SHARD_BYTES, write_with_info

    if args.fmt in ("int4", "fp8"):
        return _cli_k2(args)
    args.shard_bytes = args.shard_bytes or DEFAULT_SHARD_BYTES
    opts = TinyOptions(
        experts=args.experts,
        top_k=args.top_k,
        layers=args.layers,
        fmt=args.fmt,
        expert_hidden=args.expert_hidden,
        moe_intermediate=args.moe_intermediate,
        multimodal=args.multimodal,
        kimi_tokenizer=args.kimi_tokenizer,
        **_vocab(args),
    )
    info = write_with_info(args.out, opts, seed=args.seed, shard_bytes=args.shard_bytes)
    for f in info.files:
        print(f"{f.stat().st_size:>12,}  {f}")
    print(f"total {info.total_bytes:,} bytes in {len(info.files)} files")
    print(
        f"experts {info.experts} ({opts.layers - 1} MoE layers x {opts.experts}), "
        f"format {opts.fmt}, top-{opts.top_k}"
    )
    _print_split(info.split_experts)
    return 0


def _cli_k2(args: argparse.Namespace) -> int:
    from cachecd.testbed import tiny_k2

    if args.multimodal:
        raise InvalidRequest("--multimodal adds K3's vision weights: use it with --format "
                             "mxfp4 or fp32")
    opts = tiny_k2.K2Options(experts=args.experts, top_k=args.top_k, layers=args.layers,
                             moe_intermediate=args.moe_intermediate, fmt=args.fmt,
                             kimi_tokenizer=args.kimi_tokenizer, **_vocab(args))
    info = tiny_k2.write_tiny_k2(args.out, opts, seed=args.seed,
                                 shard_bytes=args.shard_bytes or tiny_k2.DEFAULT_SHARD_BYTES)
    for f in info.files:
        print(f"{f.stat().st_size:>12,}  {f}")
    print(f"total {info.total_bytes:,} bytes in {len(info.files)} files")
    print(f"experts {(opts.layers - 1) * opts.experts} ({opts.layers - 1} MoE layers x "
          f"{opts.experts}), format {opts.fmt} (kimi_k2), top-{opts.top_k}")
    _print_split(info.split_experts)
    return 0


def _vocab(args: argparse.Namespace) -> dict[str, int]:
    from cachecd.testbed import kimi_tokenizer

    return {"vocab_size": kimi_tokenizer.VOCAB_SIZE} if args.kimi_tokenizer else {}


def _print_split(split: list[tuple[int, int]]) -> None:
    print(
        f"split experts (across two shards) {len(split)}: "
        + ", ".join(f"L{layer}/E{e}" for layer, e in split)
    )
