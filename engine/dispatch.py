"""Which kernel MLX runs for an expert gather, per backend, and how a streamed call keeps it.

Bit-identity needs every row of a streamed layer call to meet the kernel the resident call
would have used. The streamed weight stack holds only some experts (E) and a large call may be
split into groups of rows (B), and MLX's dispatch looks at both. Read from MLX 0.32's dispatch
code (``GatherQMM::eval_gpu``/``eval_cpu``, ``GatherMM::eval_gpu``, per backend); here ``M`` is
the rows per gathered matrix (1: mlx-lm's SwitchGLU feeds one row per (token, expert) pair),
``B`` the number of such rows, ``E`` the experts in the weight stack:

- Metal, quantized (``gather_qmm``): ``gather_qmm_rhs`` if ``M == 1 and B >= 16 and
  right_sorted and B // E >= 4``; else ``gather_qmm`` if ``M >= vector_limit`` (at least 4 on
  every device); else ``gather_qmv`` (transposed weights, as mlx-lm uses them).
- Metal, float (``gather_mm``): ``gather_mm_rhs`` if ``M == 1 and right_sorted``, else a gemv.
- CUDA, quantized: ``qmv`` if ``M * B < 8`` (and qmv supports the shape), else a qmm kernel; E
  plays no part. CUDA, float: the grouped gemm if ``M == 1 and right_sorted``, else a gemv.
- CPU: one loop over the rows, each row computed on its own; nothing is decided.

Each of those kernels computes a row from that row's input and its expert's weights alone (the
rhs kernel multiplies a tile of rows against one expert and stores only the rows routed to it),
so rows may be split across calls and extra rows added, as long as every call reaches the same
kernel. A streamed call reaches it by passing ``sorted_indices=False`` when sorting would take
the rhs kernel the resident call did not take, and a group that is too small for the kernel the
resident call takes gets dummy rows (whose outputs are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

SORT_ROWS = 64  # mlx-lm's SwitchGLU sorts rows by expert when a call has this many or more


@dataclass(frozen=True)
class Gather:
    rows: int  # B
    experts: int  # E: experts in the weight stack
    sorted: bool  # right_sorted (sorted_indices)
    m: int = 1


def kernel(backend: str, quantized: bool, g: Gather, vector_limit: int = 4) -> str:
    """The kernel MLX picks on ``backend`` ("metal", "cuda", "cpu") for this gather."""
    if backend == "metal":
        if not quantized:
            return "gather_mm_rhs" if g.m == 1 and g.sorted else "gather_mv"
        if g.m == 1 and g.rows >= 16 and g.sorted and g.rows // g.experts >= 4:
            return "gather_qmm_rhs"
        return "gather_qmm" if g.m >= vector_limit else "gather_qmv"
    if backend == "cuda":
        if not quantized:
            return "grouped_gemm" if g.m == 1 and g.sorted else "gather_mv"
        return "qmv" if g.m * g.rows < 8 else "qmm"
    return "cpu_rows"


def current_backend() -> str:
    """The backend the default device computes on."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


@dataclass(frozen=True)
class Fit:
    sorted: bool  # what to pass as sorted_indices
    pad: int  # dummy rows to append (routed to the call's last expert, so order holds)


def fit(backend: str, quantized: bool, target: str, rows: int, experts: int,
        sorted_rows: bool) -> Fit:
    """How a call over ``rows`` rows and ``experts`` experts reaches the ``target`` kernel."""
    pads = sorted({0, *(max(0, n) for n in (8 - rows, 16 - rows, 4 * experts - rows,
                                              max(16, 4 * experts) - rows))})
    flags = (sorted_rows, False) if sorted_rows else (False,)
    for pad in pads:
        for flag in flags:
            if kernel(backend, quantized, Gather(rows + pad, experts, flag)) == target:
                return Fit(flag, pad)
    raise AssertionError(f"no call over {rows} rows and {experts} experts reaches {target}")


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


def max_stack(backend: str, quantized: bool) -> int | None:
    """The most experts a weight stack may hold for every kernel to take it: CUDA's grouped gemm
    (float, sorted rows) refuses more than 1,024 groups (``cutlass_grouped_gemm_unaligned``)."""
    return 1024 if backend == "cuda" and not quantized else None
