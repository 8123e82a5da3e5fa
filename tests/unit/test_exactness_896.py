"""K3's routing width on a tiny model: 896 experts, top-16, streamed vs resident, bitwise.

The prompts are the cases where a shrunk weight stack changes what MLX's dispatch sees (B / E):
one token, one token repeated 60 times (960 rows over 16 experts; resident B / E = 1, a
16-expert stack 60), two tokens alternating, and 250 random tokens (nearly every expert). Each
runs with a pool of slots that holds every expert of both MoE layers (E = 1,792 for the kernel
decision; planned for Metal, each long call gathers over a window of 896 slots), and with one
that holds 80, so the long prompts run in groups of 40; the plans are
made for this machine's backend and, on this CPU, for Metal's (with and without neural
accelerators) and CUDA's dispatch too (their flags and dummy rows must not move a logit here, as
the CPU computes each row alike; on those GPUs they are what keeps each row's kernel).
"""

from __future__ import annotations

import numpy as np
import pytest

from cachecd_engine.formats import QUANT_SPECS
from cachecd_engine.pool.bank import EngineStats, ExpertBank
from cachecd_engine.pool.dispatch import current_backend
from cachecd_engine.streamed_moe import install_streamed_banks
from tests.exactness import assert_bitwise, run_logits
from tests.inprocess_model import DictSource, build_resident, serialize_experts

EXPERTS, TOP_K, STEPS, LAYERS = 896, 16, 2, 3  # layer 0 dense, 1 KDA, 2 MLA
FMT = "mxfp4-pack-quantized"
_rng = np.random.default_rng(896)
PROMPTS = {
    "one-token": [17],
    "repeated": [42] * 60,
    "alternating": [5, 300] * 30,
    "random-250": _rng.integers(0, 512, size=250).tolist(),
}


@pytest.fixture(scope="module")
def blobs() -> dict:  # type: ignore[type-arg]
    return serialize_experts(build_resident(FMT, experts=EXPERTS, top_k=TOP_K, layers=LAYERS), FMT)


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[list[np.ndarray], list[int]]]:
    model = build_resident(FMT, experts=EXPERTS, top_k=TOP_K, layers=LAYERS)
    return {name: run_logits(model, p, steps=STEPS) for name, p in PROMPTS.items()}


@pytest.mark.parametrize(
    ("backend", "pool_experts"),
    [("cpu", 2 * EXPERTS), ("cpu", 80), ("metal", 80), ("metal-nax", 80), ("cuda", 80),
     ("metal", 2 * EXPERTS), ("metal-nax", 2 * EXPERTS)],
)
def test_streamed_896_experts_bitwise(blobs, reference, backend: str, pool_experts: int) -> None:  # type: ignore[no-untyped-def]
    if current_backend() not in ("cpu", backend):
        pytest.skip("another backend's plan: on a GPU only its own plan keeps its kernels")
    model = build_resident(FMT, experts=EXPERTS, top_k=TOP_K, layers=LAYERS)
    source = DictSource(blobs)
    one = source.entry(1, 0).nbytes
    bank = ExpertBank(source, QUANT_SPECS[FMT], pool_experts * one, EngineStats())
    bank.backend = backend
    install_streamed_banks(model, bank)
    assert bank.experts_per_layer == EXPERTS
    for name, prompt in PROMPTS.items():
        ref, toks = reference[name]
        bank.stats.reset()
        got, _ = run_logits(model, prompt, toks, steps=STEPS)
        assert_bitwise(ref, got)
        if name == "random-250":  # 4,000 rows: nearly every expert of a layer
            moe_layers = LAYERS - 1
            prefill = bank.stats.experts_routed - STEPS * moe_layers * TOP_K
            assert prefill / moe_layers > 700
            split = bank.stats.groups > bank.stats.layer_calls
            assert split == (pool_experts < EXPERTS)
            if backend.startswith("metal") and pool_experts > EXPERTS:
                # A pool of two layers: each prefill call gathers over a window of one layer's
                # slots (the resident call's E), with no dummy row (a flat pool pads 4,000
                # rows to 7,168: test_dispatch.py).
                assert bank.stats.windowed == moe_layers and bank.stats.padded_rows == 0
                assert bank.stats.swapped > 0  # the earlier prompts scattered some experts
    assert bank.capacity == pool_experts
