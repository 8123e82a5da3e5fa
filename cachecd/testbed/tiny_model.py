"""A random Kimi-K3-architecture checkpoint in K3's on-disk layout (``cachecd tiny-model``).

Invariants:
- Same seed and options => byte-identical files (values come from per-tensor generators seeded
  by (seed, tensor name); no timestamps anywhere; JSON is written with sorted keys).
- Shards are cut as HF cuts them: tensors in name order, a new shard when the next tensor would
  take the current one past ``shard_bytes``; within a shard safetensors orders by dtype, then
  name, so one expert's six U8 tensors are one contiguous range unless a cut falls inside it.
  The index (model.safetensors.index.json) is written even for a single shard.
- The fp32 format holds the same numbers: non-expert values are bf16-exact and each fp32 expert
  is the exact dequantization of the mxfp4 expert of the same seed.
- Writing removes any ``model*.safetensors`` already in OUT first, since mlx-lm loads every
  file matching that pattern.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import TensorSpec, serialize_file

from cachecd.manifest.dtypes import writer_name
from cachecd.testbed.tiny_config import (
    TensorDef,
    TinyOptions,
    expert_defs,
    model_config,
    tensor_defs,
    tokenizer_of,
)
from cachecd.testbed.tiny_shards import ShardPlan, plan_shards, split_experts

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 256 * 1024  # 12 shards and 4 split experts at the default size
INDEX_NAME = "model.safetensors.index.json"
# e2m1 code -> value; codes 8..15 are the negatives of 0..7.
_FP4_VALUES = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32
)
_PRINTABLE = [*range(0x20, 0x7F), 0x0A]
_SCALE_LOW, _SCALE_HIGH = 121, 123  # e8m0 bytes: 2^-6 .. 2^-4


@dataclass(frozen=True)
class TinyModelInfo:
    """What a write produced, for the CLI and for callers that want to check the layout."""

    out: Path
    files: list[Path]
    total_bytes: int
    experts: int
    split_experts: list[tuple[int, int]]


def write_tiny_model(
    out: Path,
    *,
    seed: int = 0,
    experts: int = 32,
    top_k: int = 4,
    layers: int = 6,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    fmt: str = "mxfp4",
    expert_hidden: int = 64,
    moe_intermediate: int = 64,
    hidden: int = 128,
    vocab_size: int = 384,
) -> Path:
    """Write the checkpoint into ``out`` (created if missing) and return ``out``."""
    opts = TinyOptions(
        experts=experts,
        top_k=top_k,
        layers=layers,
        fmt=fmt,
        expert_hidden=expert_hidden,
        moe_intermediate=moe_intermediate,
        hidden=hidden,
        vocab_size=vocab_size,
    )
    write_with_info(out, opts, seed=seed, shard_bytes=shard_bytes)
    return out


def write_with_info(out: Path, opts: TinyOptions, *, seed: int, shard_bytes: int) -> TinyModelInfo:
    defs = tensor_defs(opts)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("model*.safetensors"):
        stale.unlink()
    plan = plan_shards(defs, shard_bytes)
    files = _write_shards(out, plan, opts, seed)
    files.append(_write_index(out, plan))
    files += _write_configs(out, opts)
    files += tokenizer_of(opts.kimi_tokenizer).write_tokenizer(out, opts.vocab_size)
    split = split_experts(plan)
    info = TinyModelInfo(
        out=out,
        files=files,
        total_bytes=sum(f.stat().st_size for f in files),
        experts=(opts.layers - 1) * opts.experts,
        split_experts=split,
    )
    log.info(
        "tiny_model_written out=%s shards=%d bytes=%d split_experts=%d",
        out,
        len(plan.shards),
        info.total_bytes,
        len(split),
    )
    return info


def _write_shards(out: Path, plan: ShardPlan, opts: TinyOptions, seed: int) -> list[Path]:
    return [
        write_shard(out / file_name, shard, lambda t: tensor_values(t, opts, seed))
        for file_name, shard in zip(plan.file_names, plan.shards, strict=True)
    ]


def write_shard(path: Path, shard: list[Any], values: Callable[[Any], np.ndarray]) -> Path:
    """One safetensors shard through the safetensors library (its own on-disk tensor order)."""
    arrays = {t.name: values(t) for t in shard}
    specs = {
        t.name: TensorSpec(
            dtype=writer_name(t.dtype),
            shape=list(t.shape),
            data_ptr=arrays[t.name].ctypes.data,
            data_len=arrays[t.name].nbytes,
        )
        for t in shard
    }
    # ``arrays`` stays referenced until serialize_file returns: the specs hold raw pointers.
    serialize_file(specs, str(path), metadata={"format": "pt"})
    del arrays
    return path


def _write_index(out: Path, plan: ShardPlan) -> Path:
    weight_map = {
        t.name: f for f, shard in zip(plan.file_names, plan.shards, strict=True) for t in shard
    }
    index = {"metadata": {"total_size": plan.total_size}, "weight_map": weight_map}
    path = out / INDEX_NAME
    path.write_text(_dumps(index), encoding="utf-8")
    return path


def _write_configs(out: Path, opts: TinyOptions) -> list[Path]:
    tok = tokenizer_of(opts.kimi_tokenizer)
    eos = tok.token_id(tok.EOS_CHAT)
    bos = tok.token_id(tok.BOS)
    eos_ids = [eos, tok.token_id(tok.EOS)]
    generation = {"bos_token_id": bos, "eos_token_id": eos_ids, "do_sample": False}
    paths = [out / "config.json", out / "generation_config.json"]
    paths[0].write_text(_dumps(model_config(opts, eos_id=eos, bos_id=bos)), encoding="utf-8")
    paths[1].write_text(_dumps(generation), encoding="utf-8")
    return paths


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])


def tensor_values(t: TensorDef, opts: TinyOptions, seed: int) -> np.ndarray:
    """The stored array of one tensor: uint16 bit patterns for BF16, else its own dtype."""
    if t.kind == "packed":
        return _rng(seed, t.name).integers(0, 256, size=t.shape, dtype=np.uint8)
    if t.kind == "scale":
        return _rng(seed, t.name).integers(
            _SCALE_LOW, _SCALE_HIGH + 1, size=t.shape, dtype=np.uint8
        )
    if t.kind == "expert_f32":
        return _dequantized_expert(t, opts, seed)
    values = _bf16_round(_float_values(t, _rng(seed, t.name), opts))
    if t.dtype == "BF16":
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    return values


def _float_values(t: TensorDef, rng: np.random.Generator, opts: TinyOptions) -> np.ndarray:
    shape = t.shape
    if t.kind == "linear":
        return rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])
    if t.kind == "head":
        # Peaked enough that greedy decoding varies. Rows other than printable ASCII are damped
        # so a random model mostly writes readable text and rarely ends on its own.
        w = rng.standard_normal(shape, dtype=np.float32) * (4.0 / np.sqrt(shape[-1]))
        damped = np.ones(shape[0], dtype=bool)
        damped[_PRINTABLE] = False
        w[damped] *= 0.1
        return w
    if t.kind == "embed":
        return rng.standard_normal(shape, dtype=np.float32)
    if t.kind == "norm":
        return 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    if t.kind == "conv":
        return rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])
    if t.kind == "a_log":
        return np.log(rng.uniform(1.0, 16.0, size=shape)).astype(np.float32)
    if t.kind == "bias":
        return 0.01 * rng.standard_normal(shape, dtype=np.float32)
    if t.kind == "zeros":
        return np.zeros(shape, dtype=np.float32)
    raise ValueError(f"no value rule for tensor kind {t.kind!r} ({t.name})")


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bf16 (ties to even), returned as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def dequantize_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """[out, in/2] e2m1 pairs (low nibble first) and [out, in/32] e8m0 -> float32 [out, in]."""
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    values = _FP4_VALUES[codes]
    factors = np.exp2(scale.astype(np.float32) - 127.0)
    return (values.reshape(scale.shape[0], scale.shape[1], -1) * factors[..., None]).reshape(
        values.shape
    )


def _dequantized_expert(t: TensorDef, opts: TinyOptions, seed: int) -> np.ndarray:
    base = t.name[: -len(".weight")]
    mx_opts = dataclasses.replace(opts, fmt="mxfp4")
    prefix = base.rsplit(".", 1)[0]
    by_name = {d.name: d for d in expert_defs(prefix, mx_opts)}
    packed = tensor_values(by_name[f"{base}.weight_packed"], mx_opts, seed)
    scale = tensor_values(by_name[f"{base}.weight_scale"], mx_opts, seed)
    return dequantize_mxfp4(packed, scale)
