"""The streamed switch bank against mlx-lm's resident kimi_k3, built in-process.

The model is mlx-lm's own kimi_k3 at a tiny size (KDA and MLA layers, attention residuals, a
dense first layer, shared experts, a latent expert space). The routed experts are serialized to
checkpoint-layout bytes and served from a dict, so the streamed path parses the same bytes a
checkpoint holds. Every logit must be bitwise equal, over prefill (>= 64 routed rows: the sorted
gather path) and 20 greedy decode steps, with the RAM tier off, cold and warm.
"""

from __future__ import annotations

import numpy as np
import pytest
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models import kimi_k3

from cachecd import errors
from cachecd_engine.bank import EngineStats, ExpertBank, remap
from cachecd_engine.dispatch import current_backend
from cachecd_engine.formats import QUANT_SPECS
from cachecd_engine.prefetch import install_prefetch
from cachecd_engine.ram_tier import RamTier
from cachecd_engine.streamed_moe import StreamedSwitchGLU, install_streamed_banks
from tests.exactness import assert_bitwise
from tests.exactness import run_logits as shared_run_logits
from tests.inprocess_model import DictSource, build_resident, serialize_experts

N_EXPERTS = 32
DECODE_STEPS = 20
PROMPT = [(7 * i + 3) % 500 for i in range(20)]  # 20 tokens x top-4 = 80 rows >= 64


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


def _streamed(
    fmt: str, ram_bytes: int, expert_memory: int = 1 << 30, backend: str | None = None
) -> tuple[kimi_k3.Model, DictSource, ExpertBank]:
    model = build_resident(fmt)
    source = DictSource(serialize_experts(model, fmt))
    bank = ExpertBank(
        source, QUANT_SPECS[fmt], RamTier(ram_bytes), EngineStats(), expert_memory=expert_memory
    )
    if backend is not None:
        bank.backend = backend
    assert install_streamed_banks(model, bank) == [1, 2, 3, 4, 5]
    return model, source, bank


def _nbytes(source: DictSource) -> int:
    return source.entry(1, 0).nbytes


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
    model, source, bank = _streamed(fmt, ram_bytes=1 << 30)
    bank.ram.budget = 6 * _nbytes(source)  # fewer than one layer's routed experts in prefill
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
    for e in range(N_EXPERTS):  # whichever layer-2 expert is routed first is one byte short
        data, entry = source.blobs[(2, e)]
        source.blobs[(2, e)] = (data[:-1], entry)
    with pytest.raises(errors.ExpertSizeMismatch):
        run_logits(model, list(range(DECODE_STEPS)))


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


def test_ram_tier_evicts_by_its_policy_under_its_budget() -> None:
    tier = RamTier(budget=300, policy="lru")
    for e in range(3):
        assert tier.admit(1, e, 100) is not None
    found = tier.lookup(1, [0, 5])  # 0 becomes most recent
    assert list(found) == [0]
    assert tier.admit(2, 0, 100) is not None  # evicts the least recent: (1, 1)
    assert (1, 1) not in tier and (1, 0) in tier and (2, 0) in tier
    assert tier.bytes_used == 300 and len(tier) == 3
    assert tier.admit(2, 1, 301) is None  # bigger than the budget: not kept, nothing evicted
    assert (2, 1) not in tier and len(tier) == 3
    c = tier.counters
    assert (c.hits, c.misses, c.evicted_bytes) == (1, 1, 100)


def test_ram_tier_reuses_evicted_buffers() -> None:
    tier = RamTier(budget=200, policy="lru")
    first = tier.admit(1, 0, 100)
    tier.admit(1, 1, 100)
    third = tier.admit(1, 2, 100)  # evicts (1, 0): its buffer is the one handed out again
    assert first is not None and third is not None and third.ctypes.data == first.ctypes.data


def test_ram_tier_with_zero_budget_keeps_nothing() -> None:
    tier = RamTier(budget=0)
    assert tier.admit(1, 0, 1) is None
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


def test_read_ahead_and_hints_change_no_logit(resident) -> None:
    """Prefill (80 rows: sorted) hints the daemon; decode (4 rows) reads the guess ahead into
    the stack buffer. Either way every logit stays bitwise equal."""
    fmt, _, ref, toks = resident
    model, source, bank = _streamed(fmt, ram_bytes=0)
    prefetcher = install_prefetch(model, bank)
    names = {k for k, _ in tree_flatten(model.parameters())}
    got, _ = run_logits(model, toks)
    assert_bitwise(ref, got)
    assert names == {k for k, _ in tree_flatten(model.parameters())}
    # The prefill's layers 1..4 hint layers 2..5; the last MoE layer hints nothing.
    assert [layer for layer, _ in source.hints] == [2, 3, 4, 5] == [2, 3, 4, 5][: prefetcher.hints]
    # Each decode step reads ahead for layers 2..5 (one source call per guessed expert).
    assert bank.stats.staged > 0 and bank.stats.staged_hits > 0
    assert bank.stats.staged_hits <= bank.stats.staged
    # The guess is far better than chance (4 of 32 experts).
    print(f"guess recall={prefetcher.recall:.2f}")
    assert prefetcher.recall > 4 / N_EXPERTS


def test_read_ahead_copies_from_the_ram_tier_and_never_asks_the_source(resident) -> None:
    fmt, _, ref, toks = resident
    model, source, bank = _streamed(fmt, ram_bytes=1 << 30)
    for (layer, e), (data, _) in source.blobs.items():  # every expert in the tier
        blob = bank.ram.admit(layer, e, len(data))
        assert blob is not None
        blob[:] = np.frombuffer(data, np.uint8)
    install_prefetch(model, bank)
    got, _ = run_logits(model, toks)
    assert_bitwise(ref, got)
    assert source.hints == [] and source.calls == []
    s = bank.stats
    assert s.staged > 0 and 0 < s.staged_hits <= s.staged and s.ram_hits == s.experts_routed


@pytest.mark.parametrize("backend", ["cpu", "metal", "metal-nax", "cuda"])
def test_calls_split_by_the_memory_bound_stay_exact(resident, backend: str) -> None:
    """Stack buffers of 3 experts: the prefill (up to 32 experts a layer) runs in groups, decode
    (4 experts) in two. With the Metal and CUDA dispatch models some groups get dummy rows and
    the sorted flag cleared; the CPU computes every row alike, so logits must not move."""
    if current_backend() not in ("cpu", backend):
        pytest.skip("another backend's plan: on a GPU only its own plan keeps its kernels")
    fmt, _, ref, toks = resident
    model, source, bank = _streamed(fmt, ram_bytes=0, backend=backend)
    bank.expert_memory = 6 * _nbytes(source) + 1  # read at the first call
    got, _ = run_logits(model, toks)
    assert_bitwise(ref, got)
    assert bank.arena is not None and bank.arena.capacity == 3
    assert bank.stats.groups > bank.stats.layer_calls
    assert bank.arena.nbytes <= bank.expert_memory
