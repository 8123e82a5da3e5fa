"""A random DeepSeek-V3-layout checkpoint with int4 experts, as Kimi K2-Thinking ships them, or
fp8 experts, as Kimi K2-Instruct and DeepSeek-V3 ship them.

Invariants:
- Names, dtypes and shapes are those exports' (before mlx-lm's ``sanitize``): routed experts are
  ``model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj``. In int4 they hold ``weight_packed``
  (I32 [out, in/8], eight 4-bit codes per word, low nibble first), ``weight_scale``
  (BF16 [out, in/32]) and ``weight_shape`` (I32 [2] = [out, in]); codes are symmetric around 8
  (compressed-tensors "pack-quantized"), so the value is (code - 8) * scale. In fp8 they hold
  ``weight`` (F8_E4M3 [out, in]) and ``weight_scale_inv`` (F32 [ceil(out/128), ceil(in/128)]),
  and so does every other linear but the router and lm_head (block-quantized fp8).
- Every other weight is bf16, except ``e_score_correction_bias`` (fp32, as K2 keeps it and as
  mlx-lm's ``cast_predicate`` leaves it) and, in fp8, the embedding: fp32, so activations are
  fp32 and the CPU (whose ``gather_mm`` takes fp32 only) can run the bf16 experts mlx-lm
  dequantizes to. Layer 0 is dense; the others are MoE.
- Same seed and options => byte-identical files; non-expert values come from the same
  per-tensor generators as ``tiny_model``, sharding is ``tiny_shards``' rule.
- Writing removes any ``model*.safetensors`` already in OUT first (mlx-lm loads them all).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from cachecd.errors import InvalidRequest
from cachecd.manifest.dtypes import DTYPES
from cachecd.manifest.manifest import EXPERT_RE
from cachecd.testbed.tiny_config import TensorDef, TinyOptions, check_vocab, tokenizer_of
from cachecd.testbed.tiny_model import _rng, _write_index, tensor_values, write_shard
from cachecd.testbed.tiny_shards import ShardPlan, plan_shards

log = logging.getLogger(__name__)

GROUP = 32  # compressed-tensors group size, which mlx-lm maps to affine 4-bit group 32
FORMATS = ("int4", "fp8")
FP8_BLOCK = 128  # weight_block_size of K2-Instruct and DeepSeek-V3
DEFAULT_SHARD_BYTES = 96 * 1024
# Per-group scales in bf16: with codes in -8..7 this gives weights of roughly 1/sqrt(64).
_SCALE_LOW, _SCALE_HIGH = 0.01, 0.04
# fp8 (e4m3fn) codes with exponents 4..8 are 2^-3..2^1 (never NaN); block scales make ~0.1.
_FP8_EXP_LOW, _FP8_EXP_HIGH = 4, 8
_FP8_SCALE_LOW, _FP8_SCALE_HIGH = 0.02, 0.06
# MLA geometry: small, with K2's structure (q LoRA, decoupled rope dims).
_HEADS, _Q_LORA, _KV_LORA, _NOPE, _ROPE, _V_HEAD = 4, 64, 32, 16, 8, 16
# Values for the non-expert kinds do not depend on the options; tiny_model's signature wants some.
_VALUE_OPTS = TinyOptions()


@dataclass(frozen=True)
class K2Options:
    """Everything that decides the layout (the seed only decides values)."""

    experts: int = 32
    top_k: int = 4
    layers: int = 4
    hidden: int = 128
    moe_intermediate: int = 64
    dense_intermediate: int = 256
    shared_experts: int = 1
    vocab_size: int = 384
    fmt: str = "int4"
    kimi_tokenizer: bool = False

    def validate(self) -> None:
        if self.fmt not in FORMATS:
            raise InvalidRequest(f"format {self.fmt!r} is not one of {FORMATS}")
        if self.layers < 2:
            raise InvalidRequest("layers must be >= 2: layer 0 is dense, the rest are MoE")
        if not 1 <= self.top_k <= self.experts:
            raise InvalidRequest(f"top_k={self.top_k} must be in 1..experts={self.experts}")
        for name in ("hidden", "moe_intermediate"):
            value = getattr(self, name)
            if value <= 0 or value % GROUP:
                raise InvalidRequest(f"{name}={value} must be a positive multiple of {GROUP}")
        check_vocab(self.vocab_size, self.kimi_tokenizer)


@dataclass(frozen=True)
class K2ModelInfo:
    out: Path
    files: list[Path]
    total_bytes: int
    split_experts: list[tuple[int, int]]  # (layer, expert) whose tensors span two shards


def write_tiny_k2(
    out: Path,
    opts: K2Options | None = None,
    *,
    seed: int = 0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> K2ModelInfo:
    """Write the checkpoint, index, configs and tokenizer into ``out`` (created if missing)."""
    opts = opts or K2Options()
    defs = tensor_defs(opts)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("model*.safetensors"):
        stale.unlink()
    plan = _plan(defs, shard_bytes)
    files = [
        _write_shard(out / name, shard, opts, seed)
        for name, shard in zip(plan.file_names, plan.shards, strict=True)
    ]
    files.append(_write_index(out, plan))
    files += _write_configs(out, opts)
    files += tokenizer_of(opts.kimi_tokenizer).write_tokenizer(out, opts.vocab_size)
    info = K2ModelInfo(out, files, sum(f.stat().st_size for f in files), split_experts(plan))
    log.info(
        "tiny_k2_written out=%s shards=%d bytes=%d split_experts=%d",
        out,
        len(plan.shards),
        info.total_bytes,
        len(info.split_experts),
    )
    return info


# -- layout -----------------------------------------------------------------------------------


def tensor_defs(opts: K2Options) -> list[TensorDef]:
    """Every tensor of the checkpoint, sorted by name."""
    opts.validate()
    embed = "F32" if opts.fmt == "fp8" else "BF16"
    defs = [
        TensorDef("model.embed_tokens.weight", embed, (opts.vocab_size, opts.hidden), "embed"),
        TensorDef("model.norm.weight", "BF16", (opts.hidden,), "norm"),
        TensorDef("lm_head.weight", "BF16", (opts.vocab_size, opts.hidden), "head"),
    ]
    for layer in range(opts.layers):
        p = f"model.layers.{layer}"
        defs += [
            TensorDef(f"{p}.input_layernorm.weight", "BF16", (opts.hidden,), "norm"),
            TensorDef(f"{p}.post_attention_layernorm.weight", "BF16", (opts.hidden,), "norm"),
            *_mla_defs(f"{p}.self_attn", opts),
        ]
        if layer == 0:
            defs += _mlp_defs(f"{p}.mlp", opts.hidden, opts.dense_intermediate, opts)
        else:
            defs += _moe_defs(f"{p}.mlp", opts)
    return sorted(defs, key=lambda t: t.name)


def _lin(name: str, out: int, inp: int, opts: K2Options) -> list[TensorDef]:
    if opts.fmt == "fp8":
        return fp8_defs(name, out, inp)
    return [TensorDef(f"{name}.weight", "BF16", (out, inp), "linear")]


def fp8_defs(name: str, out: int, inp: int) -> list[TensorDef]:
    """A block-quantized fp8 linear: e4m3 weight and one fp32 scale per 128x128 block."""
    blocks = (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))
    return [
        TensorDef(f"{name}.weight", "F8_E4M3", (out, inp), "fp8"),
        TensorDef(f"{name}.weight_scale_inv", "F32", blocks, "fp8_scale"),
    ]


def _mla_defs(p: str, opts: K2Options) -> list[TensorDef]:
    hidden = opts.hidden
    return [
        *_lin(f"{p}.q_a_proj", _Q_LORA, hidden, opts),
        TensorDef(f"{p}.q_a_layernorm.weight", "BF16", (_Q_LORA,), "norm"),
        *_lin(f"{p}.q_b_proj", _HEADS * (_NOPE + _ROPE), _Q_LORA, opts),
        *_lin(f"{p}.kv_a_proj_with_mqa", _KV_LORA + _ROPE, hidden, opts),
        TensorDef(f"{p}.kv_a_layernorm.weight", "BF16", (_KV_LORA,), "norm"),
        *_lin(f"{p}.kv_b_proj", _HEADS * (_NOPE + _V_HEAD), _KV_LORA, opts),
        *_lin(f"{p}.o_proj", hidden, _HEADS * _V_HEAD, opts),
    ]


def _mlp_defs(p: str, hidden: int, inter: int, opts: K2Options) -> list[TensorDef]:
    return [
        *_lin(f"{p}.gate_proj", inter, hidden, opts),
        *_lin(f"{p}.up_proj", inter, hidden, opts),
        *_lin(f"{p}.down_proj", hidden, inter, opts),
    ]


def _moe_defs(p: str, opts: K2Options) -> list[TensorDef]:
    shared = opts.moe_intermediate * opts.shared_experts
    defs = [
        TensorDef(f"{p}.gate.weight", "BF16", (opts.experts, opts.hidden), "linear"),
        TensorDef(f"{p}.gate.e_score_correction_bias", "F32", (opts.experts,), "bias"),
        *_mlp_defs(f"{p}.shared_experts", opts.hidden, shared, opts),
    ]
    for e in range(opts.experts):
        defs += expert_defs(f"{p}.experts.{e}", opts)
    return defs


def _expert_dims(opts: K2Options) -> dict[str, tuple[int, int]]:
    return {
        "gate_proj": (opts.moe_intermediate, opts.hidden),
        "up_proj": (opts.moe_intermediate, opts.hidden),
        "down_proj": (opts.hidden, opts.moe_intermediate),
    }


def expert_defs(p: str, opts: K2Options) -> list[TensorDef]:
    """One routed expert: gate/up map hidden -> intermediate, down maps back."""
    defs = []
    for proj, (out, inp) in _expert_dims(opts).items():
        if opts.fmt == "fp8":
            defs += fp8_defs(f"{p}.{proj}", out, inp)
            continue
        defs += [
            TensorDef(f"{p}.{proj}.weight_packed", "I32", (out, inp // 8), "int4_packed"),
            TensorDef(f"{p}.{proj}.weight_scale", "BF16", (out, inp // GROUP), "int4_scale"),
            TensorDef(f"{p}.{proj}.weight_shape", "I32", (2,), "int4_shape"),
        ]
    return defs


# -- configs ----------------------------------------------------------------------------------


def model_config(opts: K2Options, eos_id: int, bos_id: int) -> dict[str, Any]:
    """K2-Thinking's config.json keys (model_type kimi_k2, which mlx-lm maps to deepseek_v3)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": opts.vocab_size,
        "hidden_size": opts.hidden,
        "intermediate_size": opts.dense_intermediate,
        "moe_intermediate_size": opts.moe_intermediate,
        "num_hidden_layers": opts.layers,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _HEADS,
        "n_shared_experts": opts.shared_experts,
        "n_routed_experts": opts.experts,
        "num_experts_per_tok": opts.top_k,
        "routed_scaling_factor": 2.827,
        "kv_lora_rank": _KV_LORA,
        "q_lora_rank": _Q_LORA,
        "qk_nope_head_dim": _NOPE,
        "qk_rope_head_dim": _ROPE,
        "v_head_dim": _V_HEAD,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
        "quantization_config": fp8_config() if opts.fmt == "fp8" else quantization_config(),
    }


def fp8_config() -> dict[str, Any]:
    """K2-Instruct's and DeepSeek-V3's: e4m3 weights, one scale per 128x128 block."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }


def quantization_config() -> dict[str, Any]:
    """compressed-tensors int4, symmetric, group 32, on the routed experts only."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": GROUP,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": [
            "lm_head",
            r"re:.*self_attn.*",
            r"re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|down)_proj.*",
            r"re:.*mlp\.gate$",
        ],
        "kv_cache_scheme": None,
    }


def _write_configs(out: Path, opts: K2Options) -> list[Path]:
    tok = tokenizer_of(opts.kimi_tokenizer)
    eos = tok.token_id(tok.EOS_CHAT)
    bos = tok.token_id(tok.BOS)
    generation = {
        "bos_token_id": bos,
        "eos_token_id": [eos, tok.token_id(tok.EOS)],
        "do_sample": False,
    }
    paths = [out / "config.json", out / "generation_config.json"]
    for path, obj in zip(paths, (model_config(opts, eos, bos), generation), strict=True):
        path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return paths


# -- shards and values ------------------------------------------------------------------------


def _plan(defs: list[TensorDef], shard_bytes: int) -> ShardPlan:
    # tiny_shards sizes only the dtypes tiny_model writes: plan with same-size U8 stand-ins for
    # the I32 and fp8 tensors (the cut rule depends on names and byte sizes only), then swap back.
    real = {t.name: t for t in defs}
    stand_ins = [
        replace(t, dtype="U8", shape=(*t.shape[:-1], t.shape[-1] * DTYPES[t.dtype].itemsize))
        if t.dtype in ("I32", "F8_E4M3")
        else t
        for t in defs
    ]
    plan = plan_shards(stand_ins, shard_bytes)
    shards = [[real[t.name] for t in shard] for shard in plan.shards]
    return ShardPlan(shards=shards, file_names=plan.file_names, total_size=plan.total_size)


def split_experts(plan: ShardPlan) -> list[tuple[int, int]]:
    homes: dict[tuple[int, int], set[int]] = {}
    for i, shard in enumerate(plan.shards):
        for t in shard:
            m = EXPERT_RE.search(t.name)
            if m is not None:
                homes.setdefault((int(m.group(1)), int(m.group(2))), set()).add(i)
    return sorted(k for k, v in homes.items() if len(v) > 1)


def _write_shard(path: Path, shard: list[TensorDef], opts: K2Options, seed: int) -> Path:
    return write_shard(path, shard, lambda t: k2_tensor_values(t, opts, seed))


def k2_tensor_values(t: TensorDef, opts: K2Options, seed: int) -> np.ndarray:
    """The stored array of one tensor (uint16 bit patterns for BF16)."""
    if t.kind == "int4_packed":
        words = _rng(seed, t.name).integers(0, 2**32, size=t.shape, dtype=np.uint64)
        return words.astype(np.uint32).view(np.int32)
    if t.kind == "int4_scale":
        s = _rng(seed, t.name).uniform(_SCALE_LOW, _SCALE_HIGH, size=t.shape)
        return _bf16_bits(s.astype(np.float32))
    if t.kind == "int4_shape":
        proj = t.name.rsplit(".", 2)[-2]
        return np.array(_expert_dims(opts)[proj], dtype=np.int32)
    if t.kind == "fp8":
        rng = _rng(seed, t.name)
        sign = rng.integers(0, 2, size=t.shape, dtype=np.uint8) << 7
        exp = rng.integers(_FP8_EXP_LOW, _FP8_EXP_HIGH + 1, size=t.shape, dtype=np.uint8) << 3
        return sign | exp | rng.integers(0, 8, size=t.shape, dtype=np.uint8)
    if t.kind == "fp8_scale":
        s = _rng(seed, t.name).uniform(_FP8_SCALE_LOW, _FP8_SCALE_HIGH, size=t.shape)
        return s.astype(np.float32)
    return tensor_values(t, _VALUE_OPTS, seed)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    return rounded.astype(np.uint16)


def dequantize_int4(packed: np.ndarray, scale_bits: np.ndarray) -> np.ndarray:
    """I32 [out, in/8] codes and BF16-bit [out, in/32] scales -> float32 [out, in] (for checks)."""
    words = packed.view(np.uint32)
    shifts = np.arange(8, dtype=np.uint32) * 4
    codes = ((words[..., None] >> shifts) & 0xF).reshape(packed.shape[0], -1).astype(np.float32)
    scales = (scale_bits.astype(np.uint32) << 16).view(np.float32)
    groups = codes.reshape(scales.shape[0], scales.shape[1], -1) - 8.0
    return (groups * scales[..., None]).reshape(codes.shape)
