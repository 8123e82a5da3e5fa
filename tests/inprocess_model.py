"""mlx-lm's own kimi_k3 at a tiny size, built in-process, and its experts as checkpoint bytes.

The model has KDA and MLA layers, attention residuals, a dense first layer, shared experts and a
latent expert space. ``serialize_experts`` lays each routed expert out as a checkpoint does
(tensor names sorted, as safetensors orders them), and ``DictSource`` serves those bytes to the
streamed bank, so the streamed path parses what a checkpoint holds.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import xxhash
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import kimi_k3

from cachecd import errors
from cachecd.manifest.entries import ByteRange, ExpertEntry, TensorInfo


def tiny_args(experts: int = 32, top_k: int = 4, layers: int = 6) -> kimi_k3.ModelArgs:
    return kimi_k3.ModelArgs.from_dict(
        {
            "model_type": "kimi_k3",
            "vocab_size": 512,
            "hidden_size": 128,
            "num_hidden_layers": layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "intermediate_size": 256,
            "linear_attn_config": {
                "num_heads": 2,
                "head_dim": 32,
                "short_conv_kernel_size": 4,
                "kda_layers": list(range(1, layers, 2)),  # KDA and MLA layers alternate
            },
            "attn_res_block_size": 2,
            "q_lora_rank": 64,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "num_experts": experts,
            "num_experts_per_token": top_k,
            "num_shared_experts": 2,
            "moe_intermediate_size": 64,
            "routed_expert_hidden_size": 64,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
        }
    )


def build_resident(fmt: str, seed: int = 0, **args: int) -> kimi_k3.Model:
    """mlx-lm's model with random weights: bf16 + mxfp4 experts, or all fp32."""
    mx.random.seed(seed)
    model = kimi_k3.Model(tiny_args(**args))
    if fmt == "mxfp4-pack-quantized":
        keep = model.cast_predicate
        flat = [
            (k, v.astype(mx.bfloat16) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v)
            for k, v in tree_flatten(model.parameters())
        ]
        model.update(tree_unflatten(flat))
        nn.quantize(
            model,
            32,
            4,
            mode="mxfp4",
            class_predicate=lambda p, m: "switch_mlp" in p and hasattr(m, "to_quantized"),
        )
    mx.eval(model.parameters())
    model.eval()
    return model


_CHECKPOINT_NAMES = (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))


def _expert_tensors(glu: nn.Module, expert: int, fmt: str) -> list[tuple[str, str, np.ndarray]]:
    out = []
    for w, proj in _CHECKPOINT_NAMES:
        p = getattr(glu, proj)
        if fmt == "none":
            out.append((f"{w}.weight", "F32", np.array(p.weight[expert])))
        else:
            out.append((f"{w}.weight_packed", "U8", np.array(p.weight[expert]).view(np.uint8)))
            out.append((f"{w}.weight_scale", "U8", np.array(p.scales[expert])))
    return out


def serialize_experts(
    model: kimi_k3.Model, fmt: str
) -> dict[tuple[int, int], tuple[bytes, ExpertEntry]]:
    """Each expert's bytes as a checkpoint lays them out (tensor names sorted, as safetensors does)."""
    out = {}
    for layer_idx, layer in enumerate(model.layers):
        glu = getattr(layer.mlp, "switch_mlp", None)
        if glu is None:
            continue
        for e in range(glu.gate_proj.weight.shape[0]):
            prefix = f"language_model.model.layers.{layer_idx}.block_sparse_moe.experts.{e}."
            parts, tensors, offsets, pos = [], [], [], 0
            for suffix, dtype, arr in sorted(_expert_tensors(glu, e, fmt)):
                data = arr.tobytes()
                digest = xxhash.xxh3_128(data).digest()
                tensors.append(
                    TensorInfo(prefix + suffix, dtype, arr.shape, "m", pos, len(data), digest)
                )
                offsets.append(pos)
                parts.append(data)
                pos += len(data)
            blob = b"".join(parts)
            entry = ExpertEntry(
                layer_idx,
                e,
                pos,
                xxhash.xxh3_128(blob).digest(),
                (ByteRange("m", 0, pos),),
                tuple(tensors),
                tuple(offsets),
            )
            out[(layer_idx, e)] = (blob, entry)
    return out


class DictSource:
    """An ExpertSource over serialized experts; records every batch it is asked for."""

    def __init__(self, blobs: dict[tuple[int, int], tuple[bytes, ExpertEntry]]) -> None:
        self.blobs = blobs
        self.calls: list[tuple[int, list[int]]] = []
        self.hints: list[tuple[int, list[int]]] = []

    def read_into(self, layer: int, ids: list[int], targets, landed=None) -> int:  # type: ignore[no-untyped-def]
        self.calls.append((layer, list(ids)))
        written = 0
        for i, (e, target) in enumerate(zip(ids, targets, strict=True)):
            data = self.blobs[(layer, e)][0]
            if sum(v.nbytes for v in target) != len(data):
                raise errors.ExpertSizeMismatch(f"{len(data)} bytes for {layer}/{e}")
            pos = 0
            for v in target:
                v[:] = data[pos : pos + v.nbytes]
                pos += v.nbytes
                written += v.nbytes
            if landed is not None:
                landed(i, len(data))
        return written

    def entry(self, layer: int, expert: int) -> ExpertEntry:
        return self.blobs[(layer, expert)][1]

    def prefetch(self, layer: int, ids: list[int]) -> None:
        self.hints.append((layer, list(ids)))
