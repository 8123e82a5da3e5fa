"""The memory the expert kernel reads: reusable stack buffers that expert bytes are read into.

Each layer call (or each group of a large call) gets one ``StackBuffer``: per expert tensor an
MLX array ``[capacity, *shape]`` in the tensor's storage dtype, allocated once and reused. Expert
bytes are ``preadv``'d (or copied from the RAM tier) straight into a slot's rows through a
writable view of that MLX memory, so the page cache -> kernel path is one copy, and the stack
handed to the kernel is a leading slice ``[:n]`` of these arrays (a view, no copy).

Invariants:
- Two buffers alternate. A buffer is refilled only after ``settle``: every background read into
  it has finished and every output computed from it has been evaluated. So bytes the kernel is
  still reading are never overwritten (MLX evaluates lazily; the guard makes it explicit).
- Both buffers together stay within ``limit`` bytes of expert memory (``capacity`` experts each,
  each expert counted with what is computed from its bytes during a call).
- Nothing here decides which expert goes where; slots are the caller's.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, cast

import mlx.core as mx
import numpy as np

from cachecd import errors
from cachecd_engine.formats import Key, Piece, StackLayout

_MX_DTYPES = {
    np.dtype(np.uint8): mx.uint8,
    np.dtype(np.int8): mx.int8,
    np.dtype(np.int32): mx.int32,
    np.dtype(np.uint32): mx.uint32,
    np.dtype(np.float16): mx.float16,
    np.dtype(np.uint16): mx.uint16,
    np.dtype(np.float32): mx.float32,
}


ALIGN = 64  # a cache line


def _aligned(shape: tuple[int, ...], dtype: mx.Dtype, nbytes: int) -> mx.array:
    """A zeroed MLX array whose data starts on a cache line. The kernel's copy into user
    memory ran 3x slower here into MLX's CPU buffers, which start 24 bytes past one (measured:
    preadv of page-cached blobs 1.5-2.4 GiB/s there, 4.9-5.7 GiB/s 64-byte aligned)."""
    base = mx.zeros((nbytes + ALIGN,), mx.uint8)
    mx.eval(base)
    addr = _bytes(base).ctypes.data
    _huge_pages(addr, nbytes + ALIGN)
    off = -addr % ALIGN
    arr = base[off : off + nbytes].view(dtype).reshape(shape)  # a view: shares base's memory
    mx.eval(arr)
    return arr


def _bytes(arr: mx.array) -> np.ndarray:
    """A writable uint8 numpy view of an evaluated MLX array's memory (no copy)."""
    return np.frombuffer(memoryview(cast(Any, arr)), np.uint8)  # mx.array is a buffer


_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # Linux


def _huge_pages(addr: int, nbytes: int) -> None:
    """Back a buffer with huge pages where Linux allows it (numpy asks the same for its big
    arrays; MLX's allocator does not): reads into it ran 5-10% faster here. A hint: any failure
    (another OS, an old kernel, THP off) leaves the buffer as it was."""
    if not sys.platform.startswith("linux"):
        return
    page = 4096
    start, end = -(-addr // page) * page, (addr + nbytes) // page * page
    if end <= start:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0:
            libc.madvise(start, end - start, _MADV_COLLAPSE)  # the pages zeros() already touched
    except (OSError, AttributeError):
        pass


class StackBuffer:
    """One set of stack arrays; see the module docstring."""

    def __init__(self, layout: StackLayout, max_capacity: int) -> None:
        self.layout = layout
        self.max_capacity = max_capacity
        self.capacity = 0
        self.arrays: dict[Key, mx.array] = {}
        self._rows: dict[Key, np.ndarray] = {}  # uint8 [capacity, tensor bytes] views of arrays
        self._guards: list[mx.array] = []
        self._pending: list[Future[object]] = []

    @property
    def nbytes(self) -> int:
        return self.capacity * self.layout.expert_nbytes

    def reserve(self, n: int) -> None:
        """Make room for ``n`` experts (after ``settle``); grows, never shrinks."""
        if n > self.max_capacity:
            raise errors.InvalidRequest(
                f"{n} experts do not fit a stack buffer of {self.max_capacity}"
            )
        if n <= self.capacity:
            return
        cap = min(self.max_capacity, max(n, 2 * self.capacity))
        self.settle()
        self.arrays, self._rows = {}, {}  # the old buffers go before the new ones are made
        for s in self.layout.slots:
            arr = _aligned((cap, *s.shape), _MX_DTYPES[s.np_dtype], cap * s.nbytes)
            self.arrays[s.key] = arr
            self._rows[s.key] = _bytes(arr).reshape(cap, -1)
        self.capacity = cap

    def targets(self, slot: int, expert_pieces: Iterable[Piece]) -> list[memoryview]:
        """Writable views, in blob order, that an expert's bytes fill to land in ``slot``."""
        return [self._rows[key][slot, :n].data for _, n, key in expert_pieces]

    def fill(self, slot: int, expert_pieces: Iterable[Piece], blob: np.ndarray) -> None:
        """Copy a whole expert blob held in memory (the RAM tier) into ``slot``."""
        for offset, n, key in expert_pieces:
            self._rows[key][slot, :n] = blob[offset : offset + n]

    def copy_out(self, slot: int, expert_pieces: Iterable[Piece], blob: np.ndarray) -> None:
        """Copy ``slot`` back into a blob-layout buffer (admission into the RAM tier)."""
        for offset, n, key in expert_pieces:
            blob[offset : offset + n] = self._rows[key][slot, :n]

    def stacks(self, n: int) -> dict[Key, mx.array]:
        """The first ``n`` slots of every tensor: what the kernel reads."""
        return {k: a[:n] for k, a in self.arrays.items()}

    def guard(self, out: mx.array) -> None:
        """``out`` was computed from this buffer: evaluate it before the buffer is refilled."""
        self._guards.append(out)

    def track(self, fut: Future[object]) -> None:
        """A background read into this buffer: wait for it before the buffer is refilled."""
        self._pending.append(fut)

    def settle(self) -> None:
        pending, self._pending = self._pending, []
        for fut in pending:
            if not fut.cancel():
                fut.exception()  # waits; a failed background read is the caller's to report
        if self._guards:
            mx.eval(self._guards)
            self._guards.clear()


class StackArena:
    """Two alternating ``StackBuffer``s within ``limit`` bytes of expert memory, an expert
    counting ``per_expert`` bytes (default: its bytes; more where the kernel's arrays are computed
    from the buffer rather than views of it: ``formats.expert_memory_nbytes``)."""

    def __init__(self, layout: StackLayout, limit: int, per_expert: int | None = None) -> None:
        cost = per_expert or layout.expert_nbytes
        per = limit // 2 // cost
        if per < 1:
            raise errors.InvalidRequest(
                f"expert memory of {limit} bytes cannot hold two experts of "
                f"{cost} bytes; raise it (cachecd run --expert-memory)"
            )
        self.layout = layout
        self.limit = limit
        self.capacity = per
        self.buffers = (StackBuffer(layout, per), StackBuffer(layout, per))
        self._turn = 0

    def next(self) -> StackBuffer:
        """The buffer the next layer call (or group) uses; the turn passes to the other."""
        buf = self.buffers[self._turn]
        self._turn ^= 1
        return buf

    def peek(self) -> StackBuffer:
        """The buffer ``next`` will return, without taking the turn (background staging)."""
        return self.buffers[self._turn]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)
