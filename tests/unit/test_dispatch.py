"""The kernel decisions MLX makes per backend, and the plans that keep streamed calls on them.

``dispatch.kernel`` restates MLX's dispatch (read from its source, see the module); these tests
pin that restatement to the cases the source spells out, then check, over many call shapes, that
every group of every plan reaches the kernel the resident call reaches, or that the call is
refused only where no flag and no number of dummy rows could reach it. They are tests of a
backend only if they can fail for it: a deliberately wrong plan, and a plan made for another
backend, must be caught on each GPU backend (on the CPU every row is computed alike, so no plan
is wrong there: its check is the exactness tests, which run on it).
"""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement

from cachecd.errors import DispatchUnmodelled
from cachecd_engine.pool import dispatch
from cachecd_engine.pool.dispatch import (
    Fit,
    Gather,
    Group,
    check_plan,
    kernel,
    metal_backend,
    nax_available,
    plan_groups,
    resident_kernel,
    tf32_enabled,
    window,
)

BACKENDS = dispatch.BACKENDS
GPUS = ("metal", "metal-nax", "cuda")
ROOT = Path(__file__).resolve().parents[2]


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
        # NAX (M5-class): the same choices; the rhs tile from B // E (< 64: 32 rows, else 64).
        ("metal-nax", True, Gather(64, 16, True), "gather_qmm_rhs_nax_bm32"),
        ("metal-nax", True, Gather(1023, 16, True), "gather_qmm_rhs_nax_bm32"),  # 63
        ("metal-nax", True, Gather(1024, 16, True), "gather_qmm_rhs_nax_bm64"),  # 64
        ("metal-nax", True, Gather(63, 16, True), "gather_qmv"),
        ("metal-nax", True, Gather(32768, 896, True), "gather_qmm_rhs_nax_bm32"),  # K3 prefill
        ("metal-nax", True, Gather(32768, 500, True), "gather_qmm_rhs_nax_bm64"),  # ... shrunk
        # Metal gather_mm: rhs whenever M == 1 and sorted; E and B play no part.
        ("metal", False, Gather(64, 896, True), "gather_mm_rhs"),
        ("metal", False, Gather(64, 1, False), "gather_mv"),
        # ... on NAX the tile: B // E > 48: 64 rows, > 24: 32, else 16.
        ("metal-nax", False, Gather(196, 4, True), "gather_mm_rhs_nax_bm64"),  # 49
        ("metal-nax", False, Gather(195, 4, True), "gather_mm_rhs_nax_bm32"),  # 48
        ("metal-nax", False, Gather(100, 4, True), "gather_mm_rhs_nax_bm32"),  # 25
        ("metal-nax", False, Gather(99, 4, True), "gather_mm_rhs_nax_bm16"),  # 24
        ("metal-nax", False, Gather(64, 1, False), "gather_mv"),
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


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(DispatchUnmodelled, match="no dispatch model for backend 'vulkan'"):
        kernel("vulkan", True, Gather(64, 16, True))


def test_sixty_identical_tokens_keep_the_resident_kernel() -> None:
    """60 tokens x top-16 on an 896-expert layer route to 16 experts. The resident call
    (E = 896) takes gather_qmv; a 16-expert stack would take gather_qmm_rhs, so the streamed call
    clears the sorted flag."""
    (g,) = plan_groups("metal", True, [60] * 16, capacity=128, resident_experts=896)
    assert resident_kernel("metal", True, 960, 896) == "gather_qmv"
    assert g.fit == Fit(sorted=False, pad=0)
    assert kernel("metal", True, Gather(960, 16, g.fit.sorted)) == "gather_qmv"


def _routed_counts(rng: np.random.Generator, rows: int, experts: int, skew: float) -> list[int]:
    p = rng.dirichlet(np.full(experts, skew))
    picks = rng.choice(experts, size=rows, p=p)
    counts = np.bincount(picks, minlength=experts)
    return [int(c) for c in counts if c]


def _cases(seed: int = 7, n: int = 400) -> list[tuple[list[int], int, int]]:
    """(counts, capacity, resident experts) of many call shapes, the same for every backend."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        resident = int(rng.choice([8, 32, 256, 896]))
        rows = int(rng.choice([1, 4, 7, 16, 60, 64, 100, 960, 3584, 5000, 32768]))
        counts = _routed_counts(rng, rows, resident, float(rng.choice([0.05, 1.0, 20.0])))
        out.append((counts, int(rng.choice([1, 2, 3, 16, 116, 1000])), resident))
    return out


def _unreachable(backend: str, quantized: bool, target: str, rows: int, experts: int,
                 sorted_rows: bool) -> bool:
    """By brute force, apart from ``fit``: no flag and no number of dummy rows reach ``target``."""
    flags = (sorted_rows, False)
    return all(kernel(backend, quantized, Gather(rows + pad, experts, flag)) != target
               for pad in range(0, 66 * experts + 20) for flag in flags)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quantized", [True, False])
def test_every_group_reaches_the_resident_kernel_or_is_refused(backend: str,
                                                               quantized: bool) -> None:
    refused = 0
    for counts, capacity, resident in _cases():
        rows = sum(counts)
        target = resident_kernel(backend, quantized, rows, resident)
        try:
            groups = plan_groups(backend, quantized, counts, capacity, resident)
        except DispatchUnmodelled:
            refused += 1
            stops = range(0, len(counts), capacity)
            assert any(_unreachable(backend, quantized, target, sum(counts[s:s + capacity]),
                                    len(counts[s:s + capacity]), rows >= dispatch.SORT_ROWS)
                       for s in stops), (backend, rows, resident, capacity)
            continue
        check_plan(backend, quantized, counts, groups, resident)
        assert [g.start for g in groups] == list(range(0, len(counts), capacity))
        assert all(g.stop - g.start <= capacity for g in groups)
        if len(groups) == 1:
            assert groups[0].fit.pad == 0  # a whole call never needs dummy rows
    # Only NAX tiles cannot always be reached, and only in some cases.
    assert (refused > 0) is (backend == "metal-nax"), refused
    assert refused < 400 // 4


def test_fit_takes_the_fewest_dummy_rows() -> None:
    for backend in GPUS:
        for quantized in (True, False):
            for counts, capacity, resident in _cases(seed=11, n=60):
                rows = sum(counts)
                target = resident_kernel(backend, quantized, rows, resident)
                for s in range(0, len(counts), capacity):
                    r, e = sum(counts[s:s + capacity]), len(counts[s:s + capacity])
                    try:
                        got = dispatch.fit(backend, quantized, target, r, e, rows >= 64).pad
                    except DispatchUnmodelled:
                        continue
                    assert all(kernel(backend, quantized, Gather(r + p, e, f)) != target
                               for p in range(got) for f in (rows >= 64, False))


def _naive(counts: list[int], capacity: int) -> list[Group]:
    """A plan that ignores the kernel: mlx-lm's sorted flag kept, no dummy rows."""
    rows = sum(counts)
    return [Group(s, min(len(counts), s + capacity), sum(counts[s:s + capacity]),
                  Fit(rows >= dispatch.SORT_ROWS, 0)) for s in range(0, len(counts), capacity)]


def _flipped(plan: list[Group]) -> list[Group]:
    """The plan with its first group's sorted flag the other way."""
    g = plan[0]
    return [Group(g.start, g.stop, g.rows, Fit(not g.fit.sorted, g.fit.pad)), *plan[1:]]


@pytest.mark.parametrize("backend", GPUS)
@pytest.mark.parametrize("quantized", [True, False])
def test_a_wrong_plan_is_caught_on_every_gpu_backend(backend: str, quantized: bool) -> None:
    """The check above is a test of ``backend`` only because plans that ignore its kernels (no
    dummy rows, or the sorted flag the other way where mlx-lm sorts), or follow another
    backend's, fail it there."""
    wrong = other = 0
    for counts, capacity, resident in _cases():
        try:
            right = plan_groups(backend, quantized, counts, capacity, resident)
        except DispatchUnmodelled:
            continue
        rows = sum(counts)
        plans = [_naive(counts, capacity)] + ([_flipped(right)] if rows >= 64 else [])
        wrong += any(_rejected(backend, quantized, counts, p, resident) for p in plans)
        try:
            theirs = plan_groups(_other(backend), quantized, counts, capacity, resident)
        except DispatchUnmodelled:
            continue
        other += _rejected(backend, quantized, counts, theirs, resident)
    assert wrong > 0, f"no call shape tells a wrong plan from a right one on {backend}"
    assert other > 0 or (not quantized and backend != "metal-nax"), \
        f"{_other(backend)}'s plans pass on {backend}"


def _rejected(backend: str, quantized: bool, counts: list[int], plan: list[Group],
              resident: int) -> bool:
    try:
        check_plan(backend, quantized, counts, plan, resident)
    except DispatchUnmodelled:
        return True
    return False


def _other(backend: str) -> str:
    return {"metal": "cuda", "metal-nax": "metal", "cuda": "metal"}[backend]


def test_check_plan_names_what_is_wrong() -> None:
    counts = [60] * 16
    good = plan_groups("metal", True, counts, capacity=128, resident_experts=896)
    check_plan("metal", True, counts, good, 896)
    wrong = [Group(0, 16, 960, Fit(sorted=True, pad=0))]  # the rhs kernel; resident is qmv
    with pytest.raises(DispatchUnmodelled, match="takes gather_qmm_rhs, not gather_qmv"):
        check_plan("metal", True, counts, wrong, 896)
    with pytest.raises(DispatchUnmodelled, match="sorts rows mlx-lm would not sort"):
        check_plan("cpu", True, [1] * 3, [Group(0, 3, 3, Fit(sorted=True, pad=0))], 896)
    thin = [Group(0, 1, 3, Fit(sorted=False, pad=0)), Group(1, 2, 60, Fit(False, 0))]
    with pytest.raises(DispatchUnmodelled, match="group 0 .* takes qmv, not qmm"):
        check_plan("cuda", True, [3, 60], thin, 896)
    with pytest.raises(DispatchUnmodelled, match="end at expert 1 of 2"):
        check_plan("cuda", True, [3, 60], [Group(0, 1, 3, Fit(False, 5))], 896)


def test_nax_tiles_are_kept_or_the_call_refused() -> None:
    """K3 on an M5: a 2,048-token prefill step (32,768 rows) over all 896 experts takes 32-row
    tiles; a streamed stack of the experts routed keeps them while they are 512 or more, and a
    call over fewer would take 64-row tiles, which no dummy row undoes."""
    assert resident_kernel("metal-nax", True, 32768, 896) == "gather_qmm_rhs_nax_bm32"
    (g,) = plan_groups("metal-nax", True, [63] * 520, capacity=1024, resident_experts=896)
    assert g.fit == Fit(True, 0)  # 32,760 rows // 520 experts == 63
    with pytest.raises(DispatchUnmodelled, match="cannot reach gather_qmm_rhs_nax_bm32"):
        plan_groups("metal-nax", True, [64] * 512, 1024, 896)  # 64 rows an expert
    # A float (bf16) group with too few rows per expert for the resident 32-row tile gets them.
    counts = [30] * 32 + [1] * 4
    assert resident_kernel("metal-nax", False, sum(counts), 32) == "gather_mm_rhs_nax_bm32"
    last = plan_groups("metal-nax", False, counts, capacity=32, resident_experts=32)[-1]
    assert (last.rows, last.fit) == (4, Fit(True, 96))  # 100 rows // 4 experts == 25


def test_cpu_needs_neither_flags_nor_pads() -> None:
    groups = plan_groups("cpu", True, [1] * 100, capacity=3, resident_experts=896)
    assert all(g.fit == Fit(sorted=True, pad=0) for g in groups)
    assert {kernel("cpu", q, Gather(r, e, s)) for q in (True, False) for r in (1, 64, 5000)
            for e in (1, 896) for s in (True, False)} == {"cpu_rows"}


def test_metal_rhs_groups_get_dummy_rows_when_too_thin() -> None:
    """Resident rhs (B // 896 >= 4); a group of 3 experts with 2 rows each would not be."""
    counts = [2, 2, 2] + [40] * 100
    rows = sum(counts)
    assert resident_kernel("metal", True, rows, 896) == "gather_qmm_rhs"
    first = plan_groups("metal", True, counts, capacity=3, resident_experts=896)[0]
    assert first.rows == 6 and first.fit == Fit(sorted=True, pad=10)  # 16 rows, 16 // 3


# -- which MLX, on which Mac ---------------------------------------------------------------------
def test_neural_accelerators_as_mlx_finds_them() -> None:
    assert nax_available("applegpu_g17s", "26.2") and nax_available("applegpu_g17g", "27.0")
    assert nax_available("applegpu_g18p", "26.2") and not nax_available("applegpu_g17p", "26.2")
    assert not nax_available("applegpu_g16s", "26.2")  # M4
    assert not nax_available("applegpu_g17s", "26.1") and not nax_available("applegpu_g17s", "")
    assert not nax_available("", "26.2") and not nax_available("applegpu_gxxs", "26.2")


def test_tf32_is_read_as_mlx_reads_it() -> None:
    assert tf32_enabled(None) and tf32_enabled("1") and tf32_enabled(" 7x")
    assert not tf32_enabled("0") and not tf32_enabled("") and not tf32_enabled("yes")


def test_an_unmodelled_mlx_runs_only_with_the_flag_and_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    assert metal_backend("0.32.2", "applegpu_g17s", "26.2", None, False) == "metal-nax"
    assert metal_backend("0.32.2", "applegpu_g16s", "26.2", None, False) == "metal"
    assert metal_backend("0.32.1", "applegpu_g17s", "15.6", None, False) == "metal"
    for version in ("0.32.0", "0.32.4", "0.33.0"):
        with pytest.raises(DispatchUnmodelled, match=f"mlx {version} is not a release") as info:
            metal_backend(version, "applegpu_g16s", "26.2", None, False)
        assert "CACHECD_ALLOW_UNMODELLED_MLX=1" in info.value.message
        assert "pip install 'mlx==0.32.2'" in info.value.message
    with pytest.raises(DispatchUnmodelled, match="MLX_ENABLE_TF32=0"):
        metal_backend("0.32.2", "applegpu_g17s", "26.2", "0", False)
    assert metal_backend("0.32.2", "applegpu_g16s", "26.2", "0", False) == "metal"  # no NAX
    with caplog.at_level(logging.WARNING, logger="cachecd_engine.pool.dispatch"):
        assert metal_backend("0.32.4", "applegpu_g17s", "26.2", None, True) == "metal-nax"
    assert "event=unmodelled_mlx mlx 0.32.4" in caplog.text


def test_mlx_on_macos_is_pinned_to_the_modelled_releases() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    mlx = [Requirement(d) for d in deps if Requirement(d).name == "mlx"]
    darwin = [r for r in mlx if r.marker and r.marker.evaluate({"sys_platform": "darwin"})]
    assert len(darwin) == 1, mlx
    releases = [f"0.{minor}.{patch}" for minor in (31, 32, 33) for patch in range(8)]
    allowed = [v for v in releases if darwin[0].specifier.contains(v)]
    assert allowed and set(allowed) <= set(dispatch.MODELLED_MLX), allowed
    # mlx-lm 0.32 asks for mlx >= 0.32.2 on macOS: the pin must leave it a release.
    assert any(darwin[0].specifier.contains(v) for v in dispatch.MODELLED_MLX if v >= "0.32.2")


@pytest.mark.parametrize("backend", ["metal", "metal-nax"])
@pytest.mark.parametrize(("tokens", "flat_rows"), [(256, 3.56), (512, 1.78), (2048, 1.0)])
def test_a_window_of_one_layer_keeps_the_resident_kernel_without_dummy_rows(
        backend: str, tokens: int, flat_rows: float) -> None:
    """K3's prefill calls (top-16 of 896) with a ~64 GB pool (3,650 slots of 17.5 MB): over the
    whole pool a call needs dummy rows to keep the resident rhs kernel (3.56x the rows at 256
    tokens, 1.78x at 512); gathered over a window of 896 slots (``window``) it meets the
    resident kernel, tile and sorted flag with none. CUDA's and the CPU's kernels do not look
    at E: no window there."""
    rows, resident, pool = tokens * 16, 896, 3650
    target = resident_kernel(backend, True, rows, resident)
    assert target.startswith("gather_qmm_rhs")
    flat = dispatch.fit(backend, True, target, rows, pool, True)
    assert round((rows + flat.pad) / rows, 2) == flat_rows
    span = window(backend, pool, resident)
    assert span == resident
    assert dispatch.fit(backend, True, target, rows, span, True) == Fit(sorted=True, pad=0)
    assert kernel(backend, True, Gather(rows, span, True)) == target
    assert window(backend, resident, resident) is None  # a pool of one layer: E is already it
    assert window("cuda", pool, resident) is None and window("cpu", pool, resident) is None
