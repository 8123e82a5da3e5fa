"""Streamed vs resident on a tiny K2-Instruct-style checkpoint (fp8 experts, 128x128 block scales).

The checkpoint comes from ``cachecd.testbed.tiny_k2`` in fp8: DeepSeek-V3 layout, model_type
kimi_k2, every linear but the router and lm_head as F8_E4M3 with an F32 ``weight_scale_inv`` per
128x128 block (192-wide experts: whole and partial blocks), small shards so some experts straddle
two files. mlx-lm's sanitize dequantizes them to bf16 at load; the engine must produce, from the
streamed fp8 bytes, the same bf16 stacks. The reference is unmodified ``mlx_lm.utils.load_model``
on the full checkpoint; every logit must be bitwise equal, cold and warm.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import load_model

from cachecd.testbed.tiny_k2 import K2Options, k2_tensor_values, tensor_defs, write_tiny_k2
from cachecd_engine.formats import StackLayout, quant_spec, stack_from_blobs
from cachecd_engine.loader import load
from cachecd_engine.local_source import LocalSource, manifest_from_dir
from cachecd_engine.pool.arrays import PoolMemory
from tests.exactness import assert_bitwise, make_resident_dir, run_logits
from tests.harness import expert_bytes_from_files
from tests.unit.test_formats import fp8_reference

PROMPT_TEXT = "Kimi K2 ships fp8 experts: every one streams and dequantizes bit for bit."
OPTS = K2Options(fmt="fp8", moe_intermediate=192)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tiny-k2-fp8")
    info = write_tiny_k2(root / "full", OPTS, seed=0)
    assert info.split_experts, "the test needs experts split across shards"
    manifest = manifest_from_dir(info.out, repo="cachecd/tiny-k2-fp8")
    assert manifest.quant_format == "fp8"
    resident_dir = make_resident_dir(info.out, manifest, root / "resident")
    reference, _ = load_model(info.out)  # strict: every tensor of the checkpoint is used
    return info.out, manifest, resident_dir, reference


def test_reference_is_bf16_dequantized_by_sanitize(checkpoint) -> None:
    """mlx-lm keeps fp8 experts as an unquantized bf16 SwitchGLU holding e4m3 x block scale."""
    _, _, _, reference = checkpoint
    layer, expert = 2, 5
    glu = reference.model.layers[layer].mlp.switch_mlp
    assert type(glu.gate_proj) is SwitchLinear and glu.gate_proj.weight.dtype == mx.bfloat16
    defs = {t.name: t for t in tensor_defs(OPTS)}
    for proj in ("gate_proj", "down_proj"):
        base = f"model.layers.{layer}.mlp.experts.{expert}.{proj}"
        codes = k2_tensor_values(defs[f"{base}.weight"], OPTS, 0)
        scales = k2_tensor_values(defs[f"{base}.weight_scale_inv"], OPTS, 0)
        assert scales.shape in ((2, 1), (1, 2))  # a whole and a partial block
        got = np.array(getattr(glu, proj).weight[expert].astype(mx.float32))
        np.testing.assert_array_equal(got, fp8_reference(codes, scales))


def test_finish_gives_each_expert_what_sanitize_gave_it(checkpoint) -> None:
    """The stack of any experts, in any order, holds per row the resident model's expert."""
    full, manifest, _, reference = checkpoint
    layer = 3
    glu = reference.model.layers[layer].mlp.switch_mlp
    for ids in ([4], [0, 9, 31], [30, 2, 17, 5]):
        entries = [manifest.expert(layer, e) for e in ids]
        stack = stack_from_blobs(quant_spec("fp8"), entries,
                                 [expert_bytes_from_files(full, e) for e in entries])
        for proj, arrays in stack.items():
            want = getattr(glu, proj).weight[mx.array(ids)]
            assert arrays["weight"].dtype == want.dtype == mx.bfloat16
            assert bool(mx.array_equal(arrays["weight"], want).item()), (ids, proj)


def test_bitwise_cold_and_warm(checkpoint) -> None:
    full, manifest, resident_dir, reference = checkpoint
    with LocalSource(manifest, full) as source:
        model, tokenizer = load(resident_dir, source, ram_bytes=1 << 30, prefetch=True)
        assert not source.calls, "loading must not ask for any expert"
        prompt = tokenizer.encode(PROMPT_TEXT)
        assert len(prompt) * OPTS.top_k >= 64  # mlx-lm's sorted gather path in the prefill
        ref, toks = run_logits(reference, prompt)
        assert all(np.isfinite(a).all() for a in ref)
        assert len({a[0, -1].tobytes() for a in ref}) == len(ref)
        cold, _ = run_logits(model, prompt, toks)
        assert_bitwise(ref, cold)
        stats = model.bank.stats
        assert stats.source_hits > 0
        stats.reset()
        warm, _ = run_logits(model, prompt, toks)
        assert_bitwise(ref, warm)
        assert stats.source_hits == 0 and stats.ram_hits > 0
    split = {(e.layer, e.expert) for e in manifest.experts() if len({r.file for r in e.ranges}) > 1}
    fetched = {(layer, e) for layer, ids in source.calls for e in ids}
    assert split & fetched, "some routed expert must be one split across shards"


def test_bitwise_in_groups_under_a_small_memory_bound(checkpoint: tuple[Path, ...]) -> None:
    """A pool of 6 slots: calls split in groups of experts; each slot's bf16 weights are
    dequantized from its fp8 bytes when it is filled, and counted in the pool's memory."""
    full, manifest, resident_dir, reference = checkpoint
    layout = StackLayout.of(manifest.expert(1, 0))
    slot = PoolMemory.slot_nbytes(quant_spec("fp8"), layout)
    assert slot > 2 * layout.expert_nbytes  # the bf16 weights count
    with LocalSource(manifest, full) as source:
        model, tokenizer = load(resident_dir, source, ram_bytes=0, expert_memory=6 * slot)
        prompt = tokenizer.encode(PROMPT_TEXT)
        ref, toks = run_logits(reference, prompt, steps=4)
        got, _ = run_logits(model, prompt, toks, steps=4)
        assert_bitwise(ref, got)
        assert model.bank.stats.groups > model.bank.stats.layer_calls
        assert model.bank.capacity == 2  # --ram 0: the smallest pool, within the cap
