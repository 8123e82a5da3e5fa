"""The streamed switch bank against mlx-lm's resident kimi_k3, built in-process.

The model is mlx-lm's own kimi_k3 at a tiny size (KDA and MLA layers, attention residuals, a
dense first layer, shared experts, a latent expert space). The routed experts are serialized to
checkpoint-layout bytes and served from a dict, so the streamed path parses the same bytes a
checkpoint holds. Every logit must be bitwise equal, over prefill (>= 64 routed rows: the sorted
gather path) and 20 greedy decode steps, with pools from two slots to every expert, cold and
warm, in groups and whole, with read-ahead.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models import kimi_k3

from cachecd import errors
from cachecd_engine.formats import QUANT_SPECS
from cachecd_engine.pool.bank import MIN_SLOTS, EngineStats, ExpertBank
from cachecd_engine.pool.dispatch import current_backend
from cachecd_engine.streamed_moe import StreamedSwitchGLU, install_prefetch, install_streamed_banks
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
    fmt: str, pool_bytes: int, cap: int | None = None, backend: str | None = None
) -> tuple[kimi_k3.Model, DictSource, ExpertBank]:
    model = build_resident(fmt)
    source = DictSource(serialize_experts(model, fmt))
    bank = ExpertBank(source, QUANT_SPECS[fmt], pool_bytes, EngineStats(), cap=cap)
    if backend is not None:
        bank.backend = backend
    assert install_streamed_banks(model, bank) == [1, 2, 3, 4, 5]
    return model, source, bank


def _nbytes(source: DictSource) -> int:
    return source.entry(1, 0).nbytes


@functools.cache
def _one(fmt: str) -> int:
    """Bytes of one expert of this format."""
    return _nbytes(DictSource(serialize_experts(build_resident(fmt), fmt)))


def test_smallest_pool_reads_every_expert_and_stays_exact(resident) -> None:
    """Two slots: each decode call (4 experts) runs in groups and reads every expert."""
    fmt, _, ref, toks = resident
    model, source, bank = _streamed(fmt, pool_bytes=0)
    got, _ = run_logits(model, toks)
    assert_bitwise(ref, got)
    assert bank.capacity == MIN_SLOTS
    assert bank.stats.groups > bank.stats.layer_calls
    assert bank.stats.source_hits == bank.stats.experts_routed
    assert all(ids == sorted(set(ids)) for _, ids in source.calls)
    assert bank.stats.rows == 5 * 4 * (len(PROMPT) + DECODE_STEPS)


def test_hits_are_slot_numbers_cold_then_warm(resident) -> None:
    """Warm, every routed expert is a hit: no read, no copy, one kernel call a layer."""
    fmt, _, ref, toks = resident
    model, source, bank = _streamed(fmt, pool_bytes=1 << 30)
    cold, _ = run_logits(model, toks)
    assert_bitwise(ref, cold)
    s = bank.stats
    # the bytes preadv returned; on a discrete CUDA GPU also the copy engine's, staging -> slot
    per_read = 2 if bank.fill.copier is not None and bank.fill.copier.on else 1
    assert s.source_hits > 0 and s.source_bytes == len(bank.table) * _nbytes(source)
    assert s.copied_bytes == per_read * s.source_bytes
    s.reset()
    asked = len(source.calls)
    warm, _ = run_logits(model, toks)
    assert_bitwise(ref, warm)
    assert s.source_hits == 0 and s.ram_hits == s.experts_routed > 0
    assert s.copied_bytes == 0 and s.groups == s.layer_calls and len(source.calls) == asked


def test_small_pool_evicts_and_stays_exact(resident) -> None:
    fmt, _, ref, toks = resident
    model, source, bank = _streamed(fmt, pool_bytes=6 * _one(fmt))
    got, _ = run_logits(model, toks)
    assert_bitwise(ref, got)
    assert bank.capacity == 6 and len(bank.table) == 6
    assert bank.table.counters.evicted > 0
    assert bank.stats.ram_hits > 0  # decode steps reuse some of the 6


def test_streamed_bank_has_no_parameters(resident) -> None:
    fmt, _, _, _ = resident
    model, _, _ = _streamed(fmt, pool_bytes=0)
    names = [k for k, _ in tree_flatten(model.parameters())]
    assert not any("switch_mlp" in k for k in names)
    assert isinstance(model.layers[1].mlp.switch_mlp, StreamedSwitchGLU)
    assert not isinstance(model.layers[0].mlp, kimi_k3.KimiK3SparseMoE)


def test_wrong_length_buffer_is_refused() -> None:
    model, source, bank = _streamed("mxfp4-pack-quantized", pool_bytes=0)
    for e in range(N_EXPERTS):  # whichever layer-2 expert is routed first is one byte short
        data, entry = source.blobs[(2, e)]
        source.blobs[(2, e)] = (data[:-1], entry)
    with pytest.raises(errors.ExpertSizeMismatch):
        run_logits(model, list(range(DECODE_STEPS)))
    assert not any(layer == 2 for layer, _ in bank.table.items())  # nothing half-read is kept


def test_one_wrong_expert_byte_changes_logits(resident) -> None:
    """The comparison is sharp: one flipped byte per expert of one layer shows in the logits."""
    fmt, _, ref, toks = resident
    model, source, _ = _streamed(fmt, pool_bytes=0)
    for e in range(N_EXPERTS):
        data, entry = source.blobs[(3, e)]
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0x10
        source.blobs[(3, e)] = (bytes(flipped), entry)
    got, _ = run_logits(model, toks)
    with pytest.raises(AssertionError):
        assert_bitwise(ref, got)


def test_read_ahead_and_hints_change_no_logit(resident) -> None:
    """Prefill (80 rows: sorted) hints the daemon; decode (4 rows) reads the guess ahead into
    free slots. Either way every logit stays bitwise equal."""
    fmt, _, ref, toks = resident
    model, source, bank = _streamed(fmt, pool_bytes=12 * _one(fmt))
    prefetcher = install_prefetch(model, bank)
    names = {k for k, _ in tree_flatten(model.parameters())}
    got, _ = run_logits(model, toks)
    assert_bitwise(ref, got)
    assert names == {k for k, _ in tree_flatten(model.parameters())}
    # The prefill's layers 1..4 hint layers 2..5; the last MoE layer hints nothing.
    assert [layer for layer, _ in source.hints] == [2, 3, 4, 5] == [2, 3, 4, 5][: prefetcher.hints]
    # Decode steps read guessed experts ahead (one source call per guessed expert).
    assert bank.stats.staged > 0 and bank.stats.staged_hits > 0
    assert bank.stats.staged_hits <= bank.stats.staged
    # The guess is far better than chance (4 of 32 experts).
    print(f"guess recall={prefetcher.recall:.2f}")
    assert prefetcher.recall > 4 / N_EXPERTS


def test_read_ahead_reads_nothing_the_pool_holds(resident) -> None:
    fmt, _, ref, toks = resident
    model, source, bank = _streamed(fmt, pool_bytes=1 << 30)
    for layer in range(1, 6):  # every expert of every layer in the pool
        bank.acquire(layer, list(range(N_EXPERTS)))
    install_prefetch(model, bank)
    asked, hints = len(source.calls), len(source.hints)
    bank.stats.reset()
    got, _ = run_logits(model, toks)
    assert_bitwise(ref, got)
    assert len(source.calls) == asked and len(source.hints) == hints
    s = bank.stats
    assert s.staged == 0 and s.ram_hits == s.experts_routed and s.copied_bytes == 0


@pytest.mark.parametrize("backend", ["cpu", "metal", "metal-nax", "cuda"])
def test_calls_bigger_than_the_pool_run_in_groups_and_stay_exact(resident, backend: str) -> None:
    """A pool of 3 experts: the prefill (up to 32 experts a layer) runs in groups, decode (4
    experts) in two. With the Metal and CUDA dispatch models some groups get dummy rows and
    the sorted flag cleared; the CPU computes every row alike, so logits must not move."""
    if current_backend() not in ("cpu", backend):
        pytest.skip("another backend's plan: on a GPU only its own plan keeps its kernels")
    fmt, _, ref, toks = resident
    one = _one(fmt)
    model, source, bank = _streamed(fmt, pool_bytes=1 << 30, cap=3 * one, backend=backend)
    got, _ = run_logits(model, toks)
    assert_bitwise(ref, got)
    assert bank.capacity == 3 and bank.memory is not None and bank.memory.nbytes <= 3 * one
    assert bank.stats.groups > bank.stats.layer_calls


def test_a_cap_too_small_for_two_experts_is_refused() -> None:
    model, source, bank = _streamed("mxfp4-pack-quantized", pool_bytes=1 << 30,
                                    cap=_one("mxfp4-pack-quantized"))
    with pytest.raises(errors.InvalidRequest, match="cannot hold two experts"):
        run_logits(model, list(range(DECODE_STEPS)))
