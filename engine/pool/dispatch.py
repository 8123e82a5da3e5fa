"""Which kernel MLX runs for an expert gather, per backend, and how a streamed call keeps it.

Bit-identity needs every row of a streamed layer call to meet the kernel the resident call
would have used. The streamed weight stack holds only some experts (E) and a large call may be
split into groups of rows (B), and MLX's dispatch looks at both. Read from MLX's dispatch code
(``GatherQMM::eval_gpu``, ``gather_qmm_rhs``, ``gather_qmm_rhs_nax``, ``GatherMM::eval_gpu``,
``gather_mm_rhs_nax``, ``is_nax_available`` and ``env::enable_tf32`` of tags v0.32.0 and v0.32.1,
and of main at 846d176, whose version.h says 0.32.2: every function named is the same there as
in v0.32.1; CUDA's and the CPU's of 0.32). ``M`` is the rows per gathered matrix (1: mlx-lm's
SwitchGLU feeds one row per (token, expert) pair), ``B`` the number of such rows, ``E`` the
experts in the weight stack:

- Metal, quantized (``gather_qmm``): ``gather_qmm_rhs`` if ``M == 1 and B >= 16 and
  right_sorted and B // E >= 4``; else ``gather_qmm`` if ``M >= vector_limit`` (at least 4 on
  every device); else ``gather_qmv`` (transposed weights, as mlx-lm uses them).
- Metal, float (``gather_mm``): ``gather_mm_rhs`` if ``M == 1 and right_sorted``, else a gemv.
- Metal with neural accelerators (NAX: M5-class GPUs, generation 17 and up, 18 for a phone's,
  on macOS 26.2 or later), for non-fp32 activations and, while ``MLX_ENABLE_TF32`` is not
  ``0`` (its default is on), for fp32 too: the same choices, but each rhs kernel is the NAX one,
  whose row tile comes from the rows per expert: quantized ``bm = 32 if B // E < 64 else 64``
  (0.32.0: always 64); float ``bm = 64 if B // E > 48, 32 if > 24, else 16``. The tile is part
  of the kernel here: a streamed call keeps the resident call's tile as well.
- CUDA, quantized: ``qmv`` if ``M * B < 8`` (and qmv supports the shape), else a qmm kernel; E
  plays no part. CUDA, float: the grouped gemm if ``M == 1 and right_sorted``, else a gemv.
- CPU: one loop over the rows, each row computed on its own; nothing is decided.

Each of those kernels computes a row from that row's input and its expert's weights alone (the
rhs kernel multiplies a tile of rows against one expert and stores only the rows routed to it),
so rows may be split across calls and extra rows added, as long as every call reaches the same
kernel. A streamed call reaches it by passing ``sorted_indices=False`` when sorting would take
the rhs kernel the resident call did not take, and a group that is too small for the kernel the
resident call takes gets dummy rows (whose outputs are dropped). Rows only add: a call whose
rows per expert already exceed the resident call's tile cannot be brought back to it, and is
refused (``DispatchUnmodelled``) rather than computed with another kernel.

On Metal the model holds only for the MLX releases it was read from (``MODELLED_MLX``, which
``pyproject.toml`` pins on macOS): another one is refused when the engine starts, unless
``CACHECD_ALLOW_UNMODELLED_MLX=1``, which runs it with a warning.
"""

from __future__ import annotations

import logging
import platform
import re
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from cachecd import constants
from cachecd.errors import DispatchUnmodelled

log = logging.getLogger(__name__)

SORT_ROWS = 64  # mlx-lm's SwitchGLU sorts rows by expert when a call has this many or more
MODELLED_MLX = ("0.32.1", "0.32.2")  # Metal dispatch read from these (module docstring)
BACKENDS = ("metal", "metal-nax", "cuda", "cpu")
NAX_MACOS = (26, 2)


@dataclass(frozen=True)
class Gather:
    rows: int  # B
    experts: int  # E: experts in the weight stack
    sorted: bool  # right_sorted (sorted_indices)
    m: int = 1


def kernel(backend: str, quantized: bool, g: Gather, vector_limit: int = 4) -> str:
    """The kernel MLX picks on ``backend`` (one of ``BACKENDS``) for this gather."""
    if backend == "metal":
        if not quantized:
            return "gather_mm_rhs" if g.m == 1 and g.sorted else "gather_mv"
        if _rhs(g):
            return "gather_qmm_rhs"
        return "gather_qmm" if g.m >= vector_limit else "gather_qmv"
    if backend == "metal-nax":
        return _nax_kernel(quantized, g, vector_limit)
    if backend == "cuda":
        if not quantized:
            return "grouped_gemm" if g.m == 1 and g.sorted else "gather_mv"
        return "qmv" if g.m * g.rows < 8 else "qmm"
    if backend == "cpu":
        return "cpu_rows"
    raise DispatchUnmodelled(f"no dispatch model for backend {backend!r} (modelled: {BACKENDS})")


def _rhs(g: Gather) -> bool:
    return g.m == 1 and g.rows >= 16 and g.sorted and g.rows // g.experts >= 4


def _nax_kernel(quantized: bool, g: Gather, vector_limit: int) -> str:
    per_expert = g.rows // g.experts
    if not quantized:
        if g.m == 1 and g.sorted:
            return f"gather_mm_rhs_nax_bm{64 if per_expert > 48 else 32 if per_expert > 24 else 16}"
        return "gather_mv"
    if _rhs(g):
        return f"gather_qmm_rhs_nax_bm{32 if per_expert < 64 else 64}"
    if g.m >= vector_limit:  # NAX or not by K, which no call of mlx-lm's SwitchGLU reaches
        raise DispatchUnmodelled("gather_qmm with several rows per matrix is not modelled on NAX")
    return "gather_qmv"


def current_backend() -> str:
    """The backend the default device computes on: "cpu", "cuda", "metal", or "metal-nax" (a
    Metal GPU with neural accelerators, whose rhs kernels tile by rows per expert). On Metal, an
    MLX whose dispatch is not modelled is refused here (see the module docstring)."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    if not mx.metal.is_available():
        return "cuda"
    return _metal()


@lru_cache(maxsize=1)
def _metal() -> str:
    arch = str(mx.device_info().get("architecture", ""))
    version: str = mx.__version__  # type: ignore[attr-defined]
    return metal_backend(version, arch, platform.mac_ver()[0], constants.MLX_ENABLE_TF32,
                         constants.ALLOW_UNMODELLED_MLX)


def metal_backend(version: str, arch: str, macos: str, tf32: str | None, allow: bool) -> str:
    """"metal" or "metal-nax" for MLX ``version`` on a GPU of architecture ``arch`` (as
    ``mx.device_info()`` names it, e.g. applegpu_g17s) under macOS ``macos``, with
    ``MLX_ENABLE_TF32`` as set (None: unset); what is not modelled raises, or with ``allow``
    warns and runs as the newest modelled release would."""
    nax = nax_available(arch, macos)
    why = []
    if version not in MODELLED_MLX:
        why.append(f"mlx {version} is not a release whose Metal dispatch cachecd models "
                   f"({', '.join(MODELLED_MLX)}; pip install 'mlx=={MODELLED_MLX[-1]}')")
    if nax and not tf32_enabled(tf32):
        why.append("MLX_ENABLE_TF32=0 on a GPU with neural accelerators makes MLX pick kernels by "
                   "the activations' dtype, which the engine's plans do not see (unset it)")
    if why:
        said = "; ".join(why)
        if not allow:
            raise DispatchUnmodelled(
                f"{said}. Streamed logits equal the resident model's only when every call takes "
                f"the resident call's kernel; set CACHECD_ALLOW_UNMODELLED_MLX=1 to run anyway "
                f"(logits may then differ from mlx-lm's in their last bits)")
        log.warning("event=unmodelled_mlx %s; running anyway (CACHECD_ALLOW_UNMODELLED_MLX=1): "
                    "streamed logits may differ from the resident model's", said)
    return "metal-nax" if nax else "metal"


def nax_available(arch: str, macos: str) -> bool:
    """MLX's ``is_nax_available``: macOS 26.2 or later, and a GPU generation of 17 or more (18 for
    a phone's), read from the architecture name's last three characters as MLX reads them."""
    if not re.fullmatch(r"\d+(\.\d+)*", macos or ""):
        return False
    if tuple(int(x) for x in (macos.split(".") + ["0"])[:2]) < NAX_MACOS or len(arch) < 3:
        return False
    digits = [int(c) if c.isdigit() else 0 for c in arch[-3:-1]]
    return digits[0] * 10 + digits[1] >= (18 if arch[-1] == "p" else 17)


def tf32_enabled(value: str | None) -> bool:
    """``MLX_ENABLE_TF32`` as MLX reads it: unset is on; set, C's atoi of it must not be 0."""
    if value is None:
        return True
    m = re.match(r"\s*([+-]?\d+)", value)
    return bool(m and int(m[1]))


@dataclass(frozen=True)
class Fit:
    sorted: bool  # what to pass as sorted_indices
    pad: int  # dummy rows to append (routed to the call's last expert, so order holds)


def _totals(rows: int, experts: int) -> list[int]:
    """Row counts where a kernel decision can change, from ``rows`` up: every threshold above."""
    marks = (8, 16, 4 * experts, 25 * experts, 49 * experts, 64 * experts)
    return sorted({rows, *(max(16, m) for m in marks if max(16, m) > rows),
                   *(m for m in marks if m > rows)})


@lru_cache(maxsize=1024)  # asked again at every layer call with the same few arguments
def fit(backend: str, quantized: bool, target: str, rows: int, experts: int,
        sorted_rows: bool) -> Fit:
    """How a call over ``rows`` rows and ``experts`` experts reaches the ``target`` kernel: the
    fewest dummy rows, the sorted flag kept where it can be; ``DispatchUnmodelled`` if none does."""
    flags = (sorted_rows, False) if sorted_rows else (False,)
    for total in _totals(rows, experts):
        for flag in flags:
            if kernel(backend, quantized, Gather(total, experts, flag)) == target:
                return Fit(flag, total - rows)
    raise DispatchUnmodelled(
        f"on {backend}, a call over {rows} rows of {experts} experts cannot reach {target}, the "
        f"kernel the resident model's call takes (rows only add, and more rows per expert take "
        f"another tile): it would compute with another kernel, so it is refused; a smaller "
        f"--prefill-step-size, or a larger pool (--ram), changes the rows per expert")


@lru_cache(maxsize=1024)
def resident_kernel(backend: str, quantized: bool, rows: int, resident_experts: int) -> str:
    """The kernel the resident model's call takes (its stack holds every expert of the layer)."""
    return kernel(backend, quantized, Gather(rows, resident_experts, rows >= SORT_ROWS))


@dataclass(frozen=True)
class Group:
    start: int  # slice of the call's experts (in stack order) this group holds
    stop: int
    rows: int  # rows routed to those experts
    fit: Fit


def plan_groups(backend: str, quantized: bool, counts: list[int], capacity: int,
                resident_experts: int) -> list[Group]:
    """Split a call's experts (``counts[i]`` rows routed to the i-th) into groups of at most
    ``capacity`` experts, each reaching the resident call's kernel."""
    rows = sum(counts)
    target = resident_kernel(backend, quantized, rows, resident_experts)
    sorted_rows = rows >= SORT_ROWS
    groups = []
    for start in range(0, len(counts), capacity):
        stop = min(len(counts), start + capacity)
        r = sum(counts[start:stop])
        groups.append(Group(start, stop, r,
                            fit(backend, quantized, target, r, stop - start, sorted_rows)))
    return groups


def check_plan(backend: str, quantized: bool, counts: list[int], groups: list[Group],
               resident_experts: int) -> None:
    """Raise ``DispatchUnmodelled`` naming the first group of ``groups`` that does not tile
    ``counts`` in order, clears or sets the sorted flag where mlx-lm would not sort, or does not
    reach the resident call's kernel on ``backend``."""
    rows = sum(counts)
    target = resident_kernel(backend, quantized, rows, resident_experts)
    pos = 0
    for i, g in enumerate(groups):
        got = kernel(backend, quantized, Gather(g.rows + g.fit.pad, g.stop - g.start, g.fit.sorted))
        why = ("does not start where the last ended" if g.start != pos else
               "does not hold the rows routed to its experts" if g.rows != sum(counts[g.start:g.stop])
               else "sorts rows mlx-lm would not sort" if g.fit.sorted and rows < SORT_ROWS
               else "has a negative pad" if g.fit.pad < 0
               else f"takes {got}, not {target}" if got != target else "")
        if why:
            raise DispatchUnmodelled(f"{backend}: group {i} ({g}) of a call over {rows} rows "
                                     f"{why}")
        pos = g.stop
    if pos != len(counts):
        raise DispatchUnmodelled(f"{backend}: the groups end at expert {pos} of {len(counts)}")


def window(backend: str, capacity: int, resident_experts: int) -> int | None:
    """The slots a call's weight stack should span on this backend, if not the whole pool.

    On Metal E is the stack's first dimension, so a pool bigger than a layer would move a
    prefill call's rows per expert (``B // E``) below the resident call's, and only dummy rows
    could bring them back (a 192-token K3 chunk with a ~64 GB pool: 9.5x the rows). A call whose
    slots lie within ``resident_experts`` contiguous slots instead gathers over that slice of
    the pool (a view, no copy): E is then the resident call's own, so the call meets the
    resident kernel and tile with no dummy row and the sorted flag as mlx-lm sets it. CUDA's
    and the CPU's kernels do not look at E: None there, and where the pool is no bigger."""
    if backend in ("metal", "metal-nax") and 0 < resident_experts < capacity:
        return resident_experts
    return None


def max_stack(backend: str, quantized: bool) -> int | None:
    """The most experts a weight stack may hold for every kernel to take it: CUDA's grouped gemm
    (float, sorted rows) refuses more than 1,024 groups (``cutlass_grouped_gemm_unaligned``)."""
    return 1024 if backend == "cuda" and not quantized else None
