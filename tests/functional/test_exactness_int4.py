"""Streamed vs resident on a tiny K2-Thinking-style checkpoint (int4 pack-quantized experts).

The checkpoint comes from ``cachecd.testbed.tiny_k2``: DeepSeek-V3 layout, model_type kimi_k2, experts as
compressed-tensors int4 (I32 packed codes, BF16 group scales, I32 shapes), small shards so some
experts straddle two files. The reference is unmodified ``mlx_lm.utils.load_model`` on the full
checkpoint; the streamed model loads a resident-only directory and reads experts through the
manifest's ranges. Every logit must be bitwise equal, cold and warm.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from cachecd.testbed.tiny_k2 import (
    K2Options,
    dequantize_int4,
    k2_tensor_values,
    tensor_defs,
    write_tiny_k2,
)
from cachecd_engine.loader import load
from cachecd_engine.local_source import LocalSource, manifest_from_dir
from cachecd_engine.streamed_moe import StreamedSwitchGLU
from tests.exactness import DECODE_STEPS, assert_bitwise, make_resident_dir, run_logits

PROMPT_TEXT = "Kimi K2 thinks in int4: every routed expert streams, bit for bit."
OPTS = K2Options()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tiny-k2")
    info = write_tiny_k2(root / "full", OPTS, seed=0)
    assert info.split_experts, "the test needs experts split across shards"
    manifest = manifest_from_dir(info.out, repo="cachecd/tiny-k2")
    assert manifest.quant_format == "pack-quantized"
    assert manifest.split_experts > 0
    resident_dir = make_resident_dir(info.out, manifest, root / "resident")
    reference, _ = load_model(info.out)  # strict: every tensor of the checkpoint is used
    return info.out, manifest, resident_dir, reference


def test_reference_experts_are_the_int4_values(checkpoint) -> None:
    """mlx-lm's stack holds (code - 8) * scale of what the generator wrote (a real int4 layout)."""
    full, _, _, reference = checkpoint
    layer, expert = 2, 5
    glu = reference.model.layers[layer].mlp.switch_mlp
    assert glu.gate_proj.mode == "affine" and glu.gate_proj.bits == 4
    assert glu.gate_proj.group_size == 32
    got = mx.dequantize(
        glu.gate_proj.weight[expert],
        # fp32 scales and biases: (code * s) + (-8 * s) is then exact, no bf16 rounding.
        glu.gate_proj.scales[expert].astype(mx.float32),
        glu.gate_proj.biases[expert].astype(mx.float32),
        group_size=32,
        bits=4,
    )
    defs = {t.name: t for t in tensor_defs(OPTS)}
    base = f"model.layers.{layer}.mlp.experts.{expert}.gate_proj"
    packed = k2_tensor_values(defs[f"{base}.weight_packed"], OPTS, 0)
    scales = k2_tensor_values(defs[f"{base}.weight_scale"], OPTS, 0)
    # Stored exactly as written: codes as uint32 words, bf16 scales, biases = -8 * scales.
    assert np.array_equal(np.array(glu.gate_proj.weight[expert]), packed.view(np.uint32))
    scale_bits = np.array(glu.gate_proj.scales[expert].view(mx.uint16))
    assert np.array_equal(scale_bits, scales)
    # And they mean (code - 8) * scale: nibble order and zero point as compressed-tensors packs.
    np.testing.assert_array_equal(np.array(got), dequantize_int4(packed, scales))


def test_bitwise_cold_and_warm(checkpoint) -> None:
    full, manifest, resident_dir, reference = checkpoint
    with LocalSource(manifest, full) as source:
        model, tokenizer = load(resident_dir, source, ram_bytes=1 << 30)
        assert not source.calls, "loading must not ask for any expert"
        banks = [layer.mlp.switch_mlp for layer in model.layers[1:]]
        assert all(isinstance(b, StreamedSwitchGLU) for b in banks)
        prompt = tokenizer.encode(PROMPT_TEXT)
        assert len(prompt) >= 16  # x top-4 >= 64 rows: mlx-lm's sorted gather path
        ref, toks = run_logits(reference, prompt)
        assert not any(np.isnan(a).any() for a in ref)
        cold, _ = run_logits(model, prompt, toks)
        assert_bitwise(ref, cold)
        stats = model.bank.stats
        # Every expert read from the source (on demand or ahead of its call) went into the tier.
        one = manifest.expert(1, 0).nbytes
        assert stats.source_hits > 0 and stats.source_bytes == len(model.bank.table) * one
        stats.reset()
        warm, _ = run_logits(model, prompt, toks)
        assert_bitwise(ref, warm)
        assert stats.source_hits == 0 and stats.ram_hits == stats.experts_routed > 0
        assert stats.layer_calls == (OPTS.layers - 1) * (DECODE_STEPS + 1)
    split = {(e.layer, e.expert) for e in manifest.experts() if len({r.file for r in e.ranges}) > 1}
    fetched = {(layer, e) for layer, ids in source.calls for e in ids}
    assert split & fetched, "some routed expert must be one split across shards"


@pytest.mark.parametrize("slots", [2, 3 * OPTS.top_k])
def test_bitwise_with_small_pools_from_full_dir(checkpoint: tuple[Path, ...], slots: int) -> None:
    """The smallest pool (two slots: every call in groups) and one of three decode calls'
    experts (read-ahead has free slots to read into); the derived biases of each slot are
    computed when it is filled."""
    full, manifest, _, reference = checkpoint
    with LocalSource(manifest, full) as source:
        one = manifest.expert(1, 0).nbytes
        model, tokenizer = load(full, source, ram_bytes=slots * one, prefetch=True)
        prompt = tokenizer.encode(PROMPT_TEXT)
        ref, toks = run_logits(reference, prompt)
        got, _ = run_logits(model, prompt, toks)
        assert_bitwise(ref, got)
        bank = model.bank
        # A slot holds the expert's bytes and its derived biases (int4: -8 x scales).
        assert bank.memory.derived and bank.slot_nbytes > one
        assert bank.capacity == max(2, slots * one // bank.slot_nbytes)
        assert bank.table.counters.evicted > 0
        if slots == 2:
            assert bank.stats.groups > bank.stats.layer_calls
            return
        # K2's gate returns (indices, scores): the next-layer guess uses it, and reads ahead.
        pf = model.prefetcher
        assert pf.routed > 0 and model.bank.stats.staged > 0
        print(f"K2 guess recall={pf.recall:.2f}")
        assert pf.recall > OPTS.top_k / OPTS.experts  # better than chance
