"""The kernel decisions MLX makes per backend, and the plans that keep streamed calls on them.

``dispatch.kernel`` restates MLX 0.32's dispatch (read from its source, see the module); these
tests pin that restatement to the cases the source spells out, then check, over many call
shapes, that every group of every plan reaches the kernel the resident call reaches.
"""

from __future__ import annotations

import numpy as np
import pytest

from cachecd_engine import dispatch
from cachecd_engine.dispatch import Gather, kernel, plan_groups, resident_kernel

BACKENDS = ("metal", "cuda", "cpu")


@pytest.mark.parametrize(
    ("backend", "quantized", "g", "want"),
    [
        # Metal gather_qmm: rhs needs M == 1, B >= 16, sorted, B // E >= 4.
        ("metal", True, Gather(64, 16, True), "gather_qmm_rhs"),
        ("metal", True, Gather(63, 16, True), "gather_qmv"),  # 63 // 16 == 3
        ("metal", True, Gather(64, 16, False), "gather_qmv"),
        ("metal", True, Gather(15, 1, True), "gather_qmv"),  # B < 16
        ("metal", True, Gather(16, 4, True), "gather_qmm_rhs"),
        ("metal", True, Gather(960, 896, True), "gather_qmv"),  # 60 tokens x 16, resident K3
        ("metal", True, Gather(960, 16, True), "gather_qmm_rhs"),  # ... and a 16-expert stack
        ("metal", True, Gather(3584, 896, True), "gather_qmm_rhs"),
        ("metal", True, Gather(64, 1, True, m=8), "gather_qmm"),  # M >= vector_limit
        # Metal gather_mm: rhs whenever M == 1 and sorted; E and B play no part.
        ("metal", False, Gather(64, 896, True), "gather_mm_rhs"),
        ("metal", False, Gather(64, 1, False), "gather_mv"),
        # CUDA gather_qmm: qmv iff M * B < 8; E plays no part.
        ("cuda", True, Gather(7, 896, True), "qmv"),
        ("cuda", True, Gather(8, 1, False), "qmm"),
        ("cuda", False, Gather(8, 1, True), "grouped_gemm"),
        ("cuda", False, Gather(8, 1, False), "gather_mv"),
        ("cpu", True, Gather(960, 16, True), "cpu_rows"),
    ],
)
def test_kernel_follows_mlx_dispatch(backend: str, quantized: bool, g: Gather, want: str) -> None:
    assert kernel(backend, quantized, g) == want


def test_sixty_identical_tokens_keep_the_resident_kernel() -> None:
    """The issue's case: 60 tokens x top-16 on an 896-expert layer route to 16 experts. The
    resident call (E = 896) takes gather_qmv; a 16-expert stack would take gather_qmm_rhs, so
    the streamed call clears the sorted flag."""
    (g,) = plan_groups("metal", True, [60] * 16, capacity=128, resident_experts=896)
    assert resident_kernel("metal", True, 960, 896) == "gather_qmv"
    assert g.fit == dispatch.Fit(sorted=False, pad=0)
    assert kernel("metal", True, Gather(960, 16, g.fit.sorted)) == "gather_qmv"


def _routed_counts(rng: np.random.Generator, rows: int, experts: int, skew: float) -> list[int]:
    p = rng.dirichlet(np.full(experts, skew))
    picks = rng.choice(experts, size=rows, p=p)
    counts = np.bincount(picks, minlength=experts)
    return [int(c) for c in counts if c]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quantized", [True, False])
def test_every_group_reaches_the_resident_kernel(backend: str, quantized: bool) -> None:
    rng = np.random.default_rng(7)
    cases = 0
    for _ in range(400):
        resident = int(rng.choice([8, 32, 256, 896]))
        rows = int(rng.choice([1, 4, 7, 16, 60, 64, 100, 960, 3584, 5000, 32768]))
        counts = _routed_counts(rng, rows, resident, float(rng.choice([0.05, 1.0, 20.0])))
        capacity = int(rng.choice([1, 2, 3, 16, 116, 1000]))
        groups = plan_groups(backend, quantized, counts, capacity, resident)
        target = resident_kernel(backend, quantized, rows, resident)
        # Groups tile the experts in order, each within the capacity, rows all accounted for.
        assert [g.start for g in groups] == list(range(0, len(counts), capacity))
        assert groups[-1].stop == len(counts)
        assert sum(g.rows for g in groups) == rows
        for g in groups:
            assert g.stop - g.start <= capacity and g.fit.pad >= 0
            got = kernel(backend, quantized, Gather(g.rows + g.fit.pad, g.stop - g.start,
                                                    g.fit.sorted))
            assert got == target, (backend, rows, resident, counts[g.start:g.stop], g)
            # The sorted flag is only ever cleared, never set on rows mlx-lm would not sort.
            assert not g.fit.sorted or rows >= dispatch.SORT_ROWS
        if len(groups) == 1:
            assert groups[0].fit.pad == 0  # a whole call never needs dummy rows
        cases += 1
    assert cases == 400


def test_cpu_needs_neither_flags_nor_pads() -> None:
    groups = plan_groups("cpu", True, [1] * 100, capacity=3, resident_experts=896)
    assert all(g.fit == dispatch.Fit(sorted=True, pad=0) for g in groups)


def test_metal_rhs_groups_get_dummy_rows_when_too_thin() -> None:
    """Resident rhs (B // 896 >= 4); a group of 3 experts with 2 rows each would not be."""
    counts = [2, 2, 2] + [40] * 100
    rows = sum(counts)
    assert resident_kernel("metal", True, rows, 896) == "gather_qmm_rhs"
    first = plan_groups("metal", True, counts, capacity=3, resident_experts=896)[0]
    assert first.rows == 6 and first.fit == dispatch.Fit(sorted=True, pad=10)  # 16 rows, 16 // 3
