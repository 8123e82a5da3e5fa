"""The shape of a tiny Kimi-K3 checkpoint: its config.json and the list of tensors it holds.

Invariants:
- Tensor names, dtypes and shapes are those of K3's own export (before mlx-lm's ``sanitize``):
  routed experts are ``...block_sparse_moe.experts.{E}.w{1,2,3}.weight_packed`` (U8, [out, in/2])
  plus ``.weight_scale`` (U8 e8m0, [out, in/32]) in mxfp4, or ``.weight`` (F32, [out, in]) in fp32.
- Non-expert weights are bf16, except A_log, dt_bias and e_score_correction_bias, which K3
  keeps in fp32 (mlx-lm's ``cast_predicate`` leaves exactly those alone). In fp32 format
  every tensor is fp32.
- With ``multimodal`` the repository also holds what K3's does beside its text model and mlx-lm
  drops in ``sanitize``: a small vision tower and projector, and a next-token-prediction layer
  (one past ``num_hidden_layers``).
- Nothing here depends on the seed: the same options give the same config and tensor list.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from cachecd.errors import InvalidRequest
from cachecd.testbed import kimi_tokenizer, tiny_tokenizer

FORMATS = ("mxfp4", "fp32")
LANG = "language_model"
MXFP4_GROUP = 32


@dataclass(frozen=True)
class TinyOptions:
    """Everything that decides a tiny checkpoint's layout (the seed only decides values)."""

    experts: int = 32
    top_k: int = 4
    layers: int = 6
    fmt: str = "mxfp4"
    expert_hidden: int = 64
    moe_intermediate: int = 64
    hidden: int = 128
    vocab_size: int = 384
    shared_experts: int = 2
    dense_intermediate: int = 256
    multimodal: bool = False
    kimi_tokenizer: bool = False

    def validate(self) -> None:
        if self.fmt not in FORMATS:
            raise InvalidRequest(f"format {self.fmt!r} is not one of {FORMATS}")
        if self.layers < 2:
            raise InvalidRequest("layers must be >= 2: layer 0 is dense, the rest are MoE")
        if not 1 <= self.top_k <= self.experts:
            raise InvalidRequest(f"top_k={self.top_k} must be in 1..experts={self.experts}")
        for name in ("expert_hidden", "moe_intermediate"):
            value = getattr(self, name)
            if value <= 0 or value % MXFP4_GROUP:
                raise InvalidRequest(f"{name}={value} must be a positive multiple of 32")
        check_vocab(self.vocab_size, self.kimi_tokenizer)


def check_vocab(vocab_size: int, kimi: bool) -> None:
    if kimi and vocab_size != kimi_tokenizer.VOCAB_SIZE:
        raise InvalidRequest(f"a Kimi-style tokenizer has {kimi_tokenizer.VOCAB_SIZE} ids: "
                             f"vocab_size must be {kimi_tokenizer.VOCAB_SIZE}")
    if vocab_size < 300:
        raise InvalidRequest("vocab_size must be >= 300 (256 bytes plus special tokens)")


def tokenizer_of(kimi: bool) -> ModuleType:
    """The tokenizer writer: Kimi-style (tiktoken + remote code) or byte-level (tokenizer.json);
    both have ``write_tokenizer(out, vocab_size)``, ``token_id(name)``, ``BOS``, ``EOS``,
    ``EOS_CHAT``."""
    return kimi_tokenizer if kimi else tiny_tokenizer


@dataclass(frozen=True)
class TensorDef:
    """One tensor as stored on disk. ``kind`` tells the value generator what it is."""

    name: str
    dtype: str  # safetensors header dtype: BF16, F32, U8
    shape: tuple[int, ...]
    kind: str  # linear, norm, embed, head, conv, a_log, zeros, bias, packed, scale


# Attention geometry: fixed, small, and shaped like K3's (MLA with q LoRA, KDA heads).
_HEADS = 4
_Q_LORA = 64
_KV_LORA = 32
_NOPE = 16
_ROPE = 8
_V_HEAD = 16
_KDA_HEADS = 4
_KDA_HEAD_DIM = 32
_CONV_KERNEL = 4


def kda_and_full_layers(layers: int) -> tuple[list[int], list[int]]:
    """1-based layer numbers: MLA every 4th layer and on the last one, KDA elsewhere."""
    full = [n for n in range(1, layers + 1) if n % 4 == 0 or n == layers]
    kda = [n for n in range(1, layers + 1) if n not in full]
    return kda, full


def text_config(opts: TinyOptions, eos_id: int, bos_id: int) -> dict[str, Any]:
    kda, full = kda_and_full_layers(opts.layers)
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": opts.vocab_size,
        "hidden_size": opts.hidden,
        "num_hidden_layers": opts.layers,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _HEADS,
        "intermediate_size": opts.dense_intermediate,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "linear_attn_config": {
            "kda_layers": kda,
            "full_attn_layers": full,
            "num_heads": _KDA_HEADS,
            "head_dim": _KDA_HEAD_DIM,
            "short_conv_kernel_size": _CONV_KERNEL,
        },
        "hidden_act": "situ",
        "attn_res_block_size": 2,
        "q_lora_rank": _Q_LORA,
        "kv_lora_rank": _KV_LORA,
        "qk_nope_head_dim": _NOPE,
        "qk_rope_head_dim": _ROPE,
        "v_head_dim": _V_HEAD,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": opts.experts,
        "num_experts_per_token": opts.top_k,
        "num_shared_experts": opts.shared_experts,
        "moe_intermediate_size": opts.moe_intermediate,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "routed_expert_hidden_size": opts.expert_hidden,
        "latent_moe_use_norm": True,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32" if opts.fmt == "fp32" else "bfloat16",
    }


def model_config(opts: TinyOptions, eos_id: int, bos_id: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text_config(opts, eos_id, bos_id),
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32" if opts.fmt == "fp32" else "bfloat16",
    }
    if opts.fmt == "mxfp4":
        config["quantization_config"] = quantization_config(opts)
    return config


def quantization_config(opts: TinyOptions) -> dict[str, Any]:
    """compressed-tensors, mxfp4 on the routed experts only; every other Linear is ignored."""
    ignore = sorted(
        t.name[: -len(".weight")]
        for t in tensor_defs(opts)
        if t.kind in ("linear", "head") and t.name.endswith(".weight")
    )
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": MXFP4_GROUP,
                    "scale_dtype": "e8m0",
                    "dynamic": False,
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ignore,
    }


def tensor_defs(opts: TinyOptions) -> list[TensorDef]:
    """Every tensor of the checkpoint, sorted by name."""
    opts.validate()
    act = "F32" if opts.fmt == "fp32" else "BF16"
    defs: list[TensorDef] = [
        TensorDef(
            f"{LANG}.model.embed_tokens.weight", act, (opts.vocab_size, opts.hidden), "embed"
        ),
        TensorDef(f"{LANG}.model.norm.weight", act, (opts.hidden,), "norm"),
        TensorDef(f"{LANG}.lm_head.weight", act, (opts.vocab_size, opts.hidden), "head"),
        *_res_defs(f"{LANG}.model.output_attn_res", opts.hidden, act),
    ]
    kda, _ = kda_and_full_layers(opts.layers)
    for layer in range(opts.layers):
        prefix = f"{LANG}.model.layers.{layer}"
        defs += _norm_defs(prefix, opts.hidden, act)
        attn = _kda_defs if layer + 1 in kda else _mla_defs
        defs += attn(f"{prefix}.self_attn", opts.hidden, act, opts.fmt)
        if layer == 0:
            defs += _mlp_defs(f"{prefix}.mlp", opts.hidden, opts.dense_intermediate, act)
        else:
            defs += _moe_defs(f"{prefix}.block_sparse_moe", opts, act)
    if opts.multimodal:
        defs += _unused_defs(opts, act)
    return sorted(defs, key=lambda t: t.name)


def _unused_defs(opts: TinyOptions, act: str) -> list[TensorDef]:
    """What a multimodal repo holds that the text model does not load."""
    vision, patch = 64, 3 * 4 * 4
    defs = [TensorDef("vision_tower.patch_embed.proj.weight", act, (vision, patch), "linear")]
    for block in range(2):
        p = f"vision_tower.encoder.blocks.{block}"
        defs += [
            TensorDef(f"{p}.attn.qkv.weight", act, (3 * vision, vision), "linear"),
            TensorDef(f"{p}.mlp.fc1.weight", act, (2 * vision, vision), "linear"),
            TensorDef(f"{p}.norm1.weight", act, (vision,), "norm"),
        ]
    defs += [
        TensorDef("mm_projector.proj.0.weight", act, (opts.hidden, vision), "linear"),
        TensorDef("mm_projector.proj.0.bias", "F32", (opts.hidden,), "bias"),
    ]
    mtp = f"{LANG}.model.layers.{opts.layers}"  # a layer past the model's: next-token prediction
    defs += [
        _lin(f"{mtp}.eh_proj", opts.hidden, 2 * opts.hidden, act),
        TensorDef(f"{mtp}.enorm.weight", act, (opts.hidden,), "norm"),
    ]
    return defs


def _res_defs(prefix: str, hidden: int, act: str) -> list[TensorDef]:
    return [
        TensorDef(f"{prefix}.proj_weight", act, (1, hidden), "linear"),
        TensorDef(f"{prefix}.norm_weight", act, (hidden,), "norm"),
    ]


def _norm_defs(prefix: str, hidden: int, act: str) -> list[TensorDef]:
    return [
        TensorDef(f"{prefix}.input_layernorm.weight", act, (hidden,), "norm"),
        TensorDef(f"{prefix}.post_attention_layernorm.weight", act, (hidden,), "norm"),
        *_res_defs(f"{prefix}.self_attention_res", hidden, act),
        *_res_defs(f"{prefix}.mlp_res", hidden, act),
    ]


def _lin(name: str, out: int, inp: int, act: str) -> TensorDef:
    return TensorDef(f"{name}.weight", act, (out, inp), "linear")


def _kda_defs(prefix: str, hidden: int, act: str, fmt: str) -> list[TensorDef]:
    proj = _KDA_HEADS * _KDA_HEAD_DIM
    f32 = "F32"
    defs = [_lin(f"{prefix}.{p}_proj", proj, hidden, act) for p in "qkv"]
    defs += [
        TensorDef(f"{prefix}.{p}_conv1d.weight", act, (proj, 1, _CONV_KERNEL), "conv")
        for p in "qkv"
    ]
    defs += [
        _lin(f"{prefix}.f_a_proj", _KDA_HEAD_DIM, hidden, act),
        _lin(f"{prefix}.f_b_proj", proj, _KDA_HEAD_DIM, act),
        _lin(f"{prefix}.b_proj", _KDA_HEADS, hidden, act),
        _lin(f"{prefix}.g_a_proj", _KDA_HEAD_DIM, hidden, act),
        _lin(f"{prefix}.g_b_proj", proj, _KDA_HEAD_DIM, act),
        TensorDef(f"{prefix}.A_log", f32, (1, 1, _KDA_HEADS, 1), "a_log"),
        TensorDef(f"{prefix}.dt_bias", f32, (proj,), "zeros"),
        TensorDef(f"{prefix}.o_norm.weight", act, (_KDA_HEAD_DIM,), "norm"),
        _lin(f"{prefix}.o_proj", hidden, proj, act),
    ]
    return defs


def _mla_defs(prefix: str, hidden: int, act: str, fmt: str) -> list[TensorDef]:
    return [
        _lin(f"{prefix}.q_a_proj", _Q_LORA, hidden, act),
        TensorDef(f"{prefix}.q_a_layernorm.weight", act, (_Q_LORA,), "norm"),
        _lin(f"{prefix}.q_b_proj", _HEADS * (_NOPE + _ROPE), _Q_LORA, act),
        _lin(f"{prefix}.kv_a_proj_with_mqa", _KV_LORA + _ROPE, hidden, act),
        TensorDef(f"{prefix}.kv_a_layernorm.weight", act, (_KV_LORA,), "norm"),
        _lin(f"{prefix}.kv_b_proj", _HEADS * (_NOPE + _V_HEAD), _KV_LORA, act),
        _lin(f"{prefix}.o_proj", hidden, _HEADS * _V_HEAD, act),
        _lin(f"{prefix}.g_proj", _HEADS * _V_HEAD, hidden, act),
    ]


def _mlp_defs(prefix: str, hidden: int, inter: int, act: str) -> list[TensorDef]:
    return [
        _lin(f"{prefix}.gate_proj", inter, hidden, act),
        _lin(f"{prefix}.up_proj", inter, hidden, act),
        _lin(f"{prefix}.down_proj", hidden, inter, act),
    ]


def _moe_defs(prefix: str, opts: TinyOptions, act: str) -> list[TensorDef]:
    shared = opts.moe_intermediate * opts.shared_experts
    defs = [
        _lin(f"{prefix}.gate", opts.experts, opts.hidden, act),
        TensorDef(f"{prefix}.gate.e_score_correction_bias", "F32", (opts.experts,), "bias"),
        *_mlp_defs(f"{prefix}.shared_experts", opts.hidden, shared, act),
        _lin(f"{prefix}.routed_expert_down_proj", opts.expert_hidden, opts.hidden, act),
        _lin(f"{prefix}.routed_expert_up_proj", opts.hidden, opts.expert_hidden, act),
        TensorDef(f"{prefix}.routed_expert_norm.weight", act, (opts.expert_hidden,), "norm"),
    ]
    for expert in range(opts.experts):
        defs += expert_defs(f"{prefix}.experts.{expert}", opts)
    return defs


def expert_defs(prefix: str, opts: TinyOptions) -> list[TensorDef]:
    """The tensors of one routed expert (w1/w3: hidden -> intermediate, w2: back)."""
    dims = {
        "w1": (opts.moe_intermediate, opts.expert_hidden),
        "w2": (opts.expert_hidden, opts.moe_intermediate),
        "w3": (opts.moe_intermediate, opts.expert_hidden),
    }
    defs: list[TensorDef] = []
    for w, (out, inp) in dims.items():
        if opts.fmt == "fp32":
            defs.append(TensorDef(f"{prefix}.{w}.weight", "F32", (out, inp), "expert_f32"))
            continue
        defs.append(TensorDef(f"{prefix}.{w}.weight_packed", "U8", (out, inp // 2), "packed"))
        defs.append(
            TensorDef(f"{prefix}.{w}.weight_scale", "U8", (out, inp // MXFP4_GROUP), "scale")
        )
    return defs
