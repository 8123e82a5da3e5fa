"""The streamed switch bank against mlx-lm's resident kimi_k3, built in-process.

The model is mlx-lm's own kimi_k3 at a tiny size (KDA and MLA layers, attention residuals, a
dense first layer, shared experts, a latent expert space). The routed experts are serialized to
checkpoint-layout bytes and served from a dict, so the streamed path parses the same bytes a
checkpoint holds. Every logit must be bitwise equal, over prefill (>= 64 routed rows: the sorted
gather path) and 20 greedy decode steps, with the RAM tier off, cold and warm.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import kimi_k3

from cachecd import errors
from cachecd.manifest import ByteRange, ExpertEntry, TensorInfo
from cachecd_engine.formats import QUANT_SPECS, DecodedExpert
from cachecd_engine.prefetch import install_prefetch
from cachecd_engine.ram_tier import RamTier
from cachecd_engine.streamed_moe import (
    EngineStats,
    ExpertBank,
    StreamedSwitchGLU,
    install_streamed_banks,
    remap,
)
from tests.exactness import assert_bitwise
from tests.exactness import run_logits as shared_run_logits

N_EXPERTS = 32
DECODE_STEPS = 20
PROMPT = [(7 * i + 3) % 500 for i in range(20)]  # 20 tokens x top-4 = 80 rows >= 64


def tiny_args() -> kimi_k3.ModelArgs:
    return kimi_k3.ModelArgs.from_dict(
        {
            "model_type": "kimi_k3",
            "vocab_size": 512,
            "hidden_size": 128,
            "num_hidden_layers": 6,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "intermediate_size": 256,
            "linear_attn_config": {
                "num_heads": 2,
                "head_dim": 32,
                "short_conv_kernel_size": 4,
                "kda_layers": [1, 3, 5],
            },
            "attn_res_block_size": 2,
            "q_lora_rank": 64,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "num_experts": N_EXPERTS,
            "num_experts_per_token": 4,
            "num_shared_experts": 2,
            "moe_intermediate_size": 64,
            "routed_expert_hidden_size": 64,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
        }
    )


def build_resident(fmt: str, seed: int = 0) -> kimi_k3.Model:
    """mlx-lm's model with random weights: bf16 + mxfp4 experts, or all fp32."""
    mx.random.seed(seed)
    model = kimi_k3.Model(tiny_args())
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
        for e in range(N_EXPERTS):
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

    def experts(self, layer: int, ids: list[int]) -> list[memoryview]:
        self.calls.append((layer, list(ids)))
        return [memoryview(self.blobs[(layer, e)][0]) for e in ids]

    def entry(self, layer: int, expert: int) -> ExpertEntry:
        return self.blobs[(layer, expert)][1]

    def prefetch(self, layer: int, ids: list[int]) -> None:
        self.hints.append((layer, list(ids)))


def run_logits(
    model: nn.Module, tokens: list[int] | None = None
) -> tuple[list[np.ndarray], list[int]]:
    """Prefill PROMPT then DECODE_STEPS greedy steps (or teacher-forced ``tokens``)."""
    return shared_run_logits(model, PROMPT, tokens, DECODE_STEPS)


@pytest.fixture(scope="module", params=["mxfp4-pack-quantized", "none"])
def resident(
    request: pytest.FixtureRequest,
) -> tuple[str, kimi_k3.Model, list[np.ndarray], list[int]]:
    fmt = request.param
    model = build_resident(fmt)
    ref, toks = run_logits(model)
    return fmt, model, ref, toks


def _streamed(fmt: str, ram_bytes: int) -> tuple[kimi_k3.Model, DictSource, ExpertBank]:
    model = build_resident(fmt)
    source = DictSource(serialize_experts(model, fmt))
    bank = ExpertBank(source, QUANT_SPECS[fmt], RamTier(ram_bytes), EngineStats())
    assert install_streamed_banks(model, bank) == [1, 2, 3, 4, 5]
    return model, source, bank


def test_streamed_bitwise_without_ram_tier(resident) -> None:
    fmt, _, ref, toks = resident
    model, source, bank = _streamed(fmt, ram_bytes=0)
    got, _ = run_logits(model, toks)
    assert_bitwise(ref, got)
    # Every layer call asked the source once, for distinct experts in ascending order.
    assert len(source.calls) == 5 * (1 + DECODE_STEPS)
    assert all(ids == sorted(set(ids)) for _, ids in source.calls)
    assert bank.stats.ram_hits == 0 and len(bank.ram) == 0
    assert bank.stats.rows == 5 * 4 * (len(PROMPT) + DECODE_STEPS)


def test_streamed_bitwise_cold_then_warm(resident) -> None:
    fmt, _, ref, toks = resident
    model, _, bank = _streamed(fmt, ram_bytes=1 << 30)
    cold, _ = run_logits(model, toks)
    assert_bitwise(ref, cold)
    assert bank.stats.source_hits > 0
    bank.stats.reset()
    warm, _ = run_logits(model, toks)
    assert_bitwise(ref, warm)
    assert bank.stats.source_hits == 0 and bank.stats.ram_hits == bank.stats.experts_routed > 0


def test_small_ram_tier_evicts_and_stays_exact(resident) -> None:
    fmt, _, ref, toks = resident
    model, _, bank = _streamed(fmt, ram_bytes=1 << 30)
    one = bank.experts(1, [0])[0].nbytes
    bank.ram.clear()
    bank.ram.budget = 6 * one  # fewer than one layer's routed experts in prefill
    got, _ = run_logits(model, toks)
    assert_bitwise(ref, got)
    assert bank.ram.counters.evicted_bytes > 0
    assert 0 < bank.ram.bytes_used <= bank.ram.budget


def test_streamed_bank_has_no_parameters(resident) -> None:
    fmt, _, _, _ = resident
    model, _, _ = _streamed(fmt, ram_bytes=0)
    names = [k for k, _ in tree_flatten(model.parameters())]
    assert not any("switch_mlp" in k for k in names)
    assert isinstance(model.layers[1].mlp.switch_mlp, StreamedSwitchGLU)
    assert not isinstance(model.layers[0].mlp, kimi_k3.KimiK3SparseMoE)


def test_wrong_length_buffer_is_refused() -> None:
    model, source, _ = _streamed("mxfp4-pack-quantized", ram_bytes=0)
    key = (2, 5)
    data, entry = source.blobs[key]
    source.blobs[key] = (data[:-1], entry)
    bank = model.layers[2].mlp.switch_mlp._bank
    with pytest.raises(errors.ExpertSizeMismatch):
        bank.experts(2, [5])


def test_one_wrong_expert_byte_changes_logits(resident) -> None:
    """The comparison is sharp: one flipped byte per expert of one layer shows in the logits."""
    fmt, _, ref, toks = resident
    model, source, _ = _streamed(fmt, ram_bytes=0)
    for e in range(N_EXPERTS):
        data, entry = source.blobs[(3, e)]
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0x10
        source.blobs[(3, e)] = (bytes(flipped), entry)
    got, _ = run_logits(model, toks)
    with pytest.raises(AssertionError):
        assert_bitwise(ref, got)


def _decoded(nbytes: int) -> DecodedExpert:
    return DecodedExpert({}, nbytes)


def test_ram_tier_is_lru_under_its_budget() -> None:
    tier = RamTier(budget=300)
    for e in range(3):
        tier.put(1, e, _decoded(100))
    found, missing = tier.get_many(1, [0, 5])  # 0 becomes most recent
    assert list(found) == [0] and missing == [5]
    tier.put(2, 0, _decoded(100))  # evicts the least recent: (1, 1)
    assert (1, 1) not in tier and (1, 0) in tier and (2, 0) in tier
    assert tier.bytes_used == 300 and len(tier) == 3
    tier.put(2, 1, _decoded(301))  # bigger than the budget: not kept, nothing evicted
    assert (2, 1) not in tier and len(tier) == 3
    c = tier.counters
    assert (c.hits, c.misses, c.evicted_bytes) == (1, 1, 100)


def test_ram_tier_with_zero_budget_keeps_nothing() -> None:
    tier = RamTier(budget=0)
    tier.put(1, 0, _decoded(1))
    assert len(tier) == 0 and tier.bytes_used == 0
    with pytest.raises(ValueError):
        RamTier(budget=-1)


@pytest.mark.parametrize("shape", [(1, 1, 4), (1, 20, 4), (2, 40, 4)])
def test_remap_is_monotonic_and_complete(shape: tuple[int, ...]) -> None:
    """Both paths (Python below 64 rows, numpy above) give ascending ids and an exact inverse."""
    rng = np.random.default_rng(sum(shape))
    routed = rng.integers(0, N_EXPERTS, size=shape).astype(np.uint32)
    ids, local = remap(routed)
    assert ids == sorted(set(routed.ravel().tolist()))
    assert local.dtype == routed.dtype and local.shape == routed.shape
    assert np.array_equal(np.array(ids, dtype=np.uint32)[local], routed)


def test_prefetch_hints_next_layer_and_changes_no_logit(resident) -> None:
    fmt, _, ref, toks = resident
    model, source, bank = _streamed(fmt, ram_bytes=0)
    prefetcher = install_prefetch(model, bank)
    names = {k for k, _ in tree_flatten(model.parameters())}
    got, _ = run_logits(model, toks)
    assert_bitwise(ref, got)
    assert names == {k for k, _ in tree_flatten(model.parameters())}
    # Layers 1..4 hint layers 2..5 once per forward; the last MoE layer hints nothing.
    assert [layer for layer, _ in source.hints[:4]] == [2, 3, 4, 5]
    assert len(source.hints) == prefetcher.hints == 4 * (1 + DECODE_STEPS)
    # Hints are guesses, but far better than chance (4 of 32 experts) on decode steps.
    routed = {(i, layer): set(ids) for i, (layer, ids) in enumerate(source.calls)}
    hits = total = 0
    for n, (layer, ids) in enumerate(source.hints[4:], start=4):
        step, pos = divmod(n, 4)
        actual = routed[(step * 5 + pos + 1, layer)]
        hits += len(actual & set(ids))
        total += len(ids)
    print(f"prefetch hint precision={hits / total:.2f}")
    assert hits / total > 4 / N_EXPERTS


def test_prefetch_skips_experts_in_the_ram_tier(resident) -> None:
    fmt, _, _, toks = resident
    model, source, bank = _streamed(fmt, ram_bytes=1 << 30)
    for layer in range(1, 6):
        bank.experts(layer, list(range(N_EXPERTS)))
    install_prefetch(model, bank)
    run_logits(model, toks)
    assert source.hints == []
