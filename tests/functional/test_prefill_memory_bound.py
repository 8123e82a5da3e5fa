"""A prefill that routes to nearly every expert of a K3-shaped layer stays within the expert
memory bound, and its logits are the resident model's, bitwise.

The checkpoint has K3's real expert shapes (17,547,264 bytes an expert: w1/w3 [3072, 3584] and
w2 [3584, 3072] in mxfp4), 48 experts in its one MoE layer, top-16. A 16-token prompt routes
256 rows to nearly all of them (842 MB of experts); the pool of expert slots holds 8 (140 MB,
allocated when the model loads), so the call runs in groups of 4. MLX's peak memory over the
streamed prefill, above what was allocated before it, must stay within the activations (a few
MB at this size). Activations are fp32 on both sides (MLX's CPU quantized matmul is ~10x
slower in bf16); the experts stay mxfp4 bytes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from cachecd.testbed.tiny_model import write_tiny_model
from cachecd_engine.loader import load
from cachecd_engine.local_source import LocalSource, manifest_from_dir
from tests.exactness import assert_bitwise

EXPERTS, TOP_K, TOKENS = 48, 16, 16
K3_EXPERT = {"expert_hidden": 3584, "moe_intermediate": 3072}
ACTIVATIONS = 64 << 20  # generous for 256 rows x 3,584 x fp32 and their intermediates


@pytest.fixture(scope="module")
def k3_layer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    root = tmp_path_factory.mktemp("k3-layer")
    full = write_tiny_model(root / "full", seed=3, experts=EXPERTS, top_k=TOP_K, layers=2,
                            shard_bytes=4_000_000_000, **K3_EXPERT)
    manifest = manifest_from_dir(full, repo="cachecd/k3-layer")
    assert manifest.experts_per_layer == EXPERTS and int(manifest.sizes[0]) == 17_547_264
    return full, manifest


def _prefill_logits(model: object, tokens: list[int]) -> np.ndarray:
    logits = model(mx.array(tokens)[None])  # type: ignore[operator]
    return np.array(logits.astype(mx.float32))


def test_k3_shaped_prefill_stays_under_the_bound(k3_layer) -> None:  # type: ignore[no-untyped-def]
    full, manifest = k3_layer
    tokens = np.random.default_rng(0).integers(0, 384, size=TOKENS).tolist()
    reference, _ = load_model(full)
    reference.set_dtype(mx.float32)
    ref = _prefill_logits(reference, tokens)
    del reference
    mx.clear_cache()

    bound = 8 * int(manifest.sizes[0]) + 1
    with LocalSource(manifest, full, verify=False) as source:
        model, _ = load(full, source, ram_bytes=bound, prefetch=False)
        assert model.bank.memory.nbytes <= bound  # the pool: allocated at load, never grown
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        got = _prefill_logits(model, tokens)
        peak = mx.get_peak_memory() - before
        stats = model.bank.stats
    assert_bitwise([ref], [got])
    routed = stats.experts_routed
    print(f"routed {routed} of {EXPERTS} experts; peak {peak / 2**20:.0f} MiB over the "
          f"{before / 2**20:.0f} MiB before; bound {bound / 2**20:.0f} MiB; groups {stats.groups}")
    assert routed >= 0.9 * EXPERTS  # nearly every expert of the layer
    assert stats.groups >= routed // 4  # 4 experts a buffer
    assert peak <= ACTIVATIONS  # beyond the pool, only activations
    assert routed * int(manifest.sizes[0]) > 4 * (bound + ACTIVATIONS)  # the bound is what held


@pytest.fixture(scope="module")
def k2_fp8_layer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """fp8 experts 1024 wide (3 MiB each), 32 of them in one MoE layer, top-8."""
    from cachecd.testbed.tiny_k2 import K2Options, write_tiny_k2

    opts = K2Options(fmt="fp8", experts=32, top_k=8, layers=2, hidden=1024, moe_intermediate=1024)
    full = write_tiny_k2(tmp_path_factory.mktemp("fp8-layer") / "full", opts, seed=3,
                         shard_bytes=4_000_000_000).out
    return full, manifest_from_dir(full, repo="cachecd/fp8-layer")


def test_fp8_prefill_counts_the_bf16_stack_in_the_bound(k2_fp8_layer: Any) -> None:
    """fp8 experts are dequantized to bf16 for the kernel (as mlx-lm keeps them) when a slot is
    filled: the pool counts them, what dequantizing takes on the way is bounded
    (``pool.DERIVE_CHUNK``), and the logits are mlx-lm's."""
    from cachecd_engine.formats import StackLayout, quant_spec
    from cachecd_engine.pool.arrays import DERIVE_CHUNK, PoolMemory
    from cachecd_engine.pool.dispatch import current_backend

    full, manifest = k2_fp8_layer
    tokens = np.random.default_rng(0).integers(0, 384, size=TOKENS).tolist()
    reference, _ = load_model(full)
    ref = _prefill_logits(reference, tokens)
    del reference
    mx.clear_cache()

    layout = StackLayout.of(manifest.expert(1, 0))
    bound = 8 * PoolMemory.slot_nbytes(quant_spec("fp8"), layout) + 1
    with LocalSource(manifest, full, verify=False) as source:
        model, _ = load(full, source, ram_bytes=bound, prefetch=False)
        assert model.bank.memory.nbytes <= bound
        mx.eval(model.parameters())
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        got = _prefill_logits(model, tokens)
        peak = mx.get_peak_memory() - before
        stats = model.bank.stats
    assert_bitwise([ref], [got])
    print(f"routed {stats.experts_routed} of 32; peak {peak / 2**20:.0f} MiB over the "
          f"{before / 2**20:.0f} MiB before; bound {bound / 2**20:.0f} MiB; groups {stats.groups}")
    assert stats.experts_routed >= 0.9 * 32 and stats.groups >= stats.experts_routed // 4
    # On the CPU, gather_mm takes fp32 only: each call casts the bf16 weights it is given (the
    # pool's, as the resident call casts its whole stack), which the peak includes.
    weights = sum(math.prod(s.shape) for s in layout.slots if s.key[1] == "weight")
    cast = 4 * weights * model.bank.capacity if current_backend() == "cpu" else 0
    assert peak <= DERIVE_CHUNK + cast + ACTIVATIONS
