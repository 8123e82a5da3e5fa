"""The slot pool's memory: one stack of expert slots the kernel reads directly, for every layer.

Per expert tensor an MLX array ``[slots, *shape]`` in the tensor's storage dtype, allocated once
(cache-line aligned, huge pages where Linux allows) and shared by every MoE layer's call: a call
passes the routed experts' slot numbers as the gather's indices, so an expert already in a slot
costs nothing to use. A missing expert's bytes are ``preadv``'d from the daemon's fds straight
into its slot through a writable view of that MLX memory: one copy, page cache to slot.

Invariants:
- The arrays the kernel reads (``arrays``) are exactly what mlx-lm's ``sanitize`` puts in the
  resident stack, slot for expert: views of the raw slots for mxfp4 and plain formats; for
  formats whose kernel arrays are computed from the bytes (int4's biases, fp8's bf16 weights),
  those are kept per slot too, computed by ``formats.finish`` (sanitize's own ops, elementwise
  per expert) when a slot is filled (``derive``).
- Nothing here decides which expert goes where, nor when a slot may be written: that is
  ``slots.SlotTable`` and the bank (a slot is written only when no queued work reads it).
"""

from __future__ import annotations

import ctypes
import math
import sys
from typing import Any, cast

import mlx.core as mx
import numpy as np

from cachecd_engine.formats import (
    Arrays,
    Key,
    Piece,
    QuantSpec,
    StackLayout,
    derive_work_nbytes,
    finish,
)
from cachecd_engine.pool.cuda_memory import Copier

_MX_DTYPES = {
    np.dtype(np.uint8): mx.uint8,
    np.dtype(np.int8): mx.int8,
    np.dtype(np.int32): mx.int32,
    np.dtype(np.uint32): mx.uint32,
    np.dtype(np.float16): mx.float16,
    np.dtype(np.uint16): mx.uint16,
    np.dtype(np.float32): mx.float32,
}
# Kernel arrays finish computes from the bytes rather than viewing them, per format.
DERIVED = {"pack-quantized": "biases", "fp8": "weight"}

ALIGN = 64  # a cache line
DERIVE_CHUNK = 64 << 20  # memory in flight computing derived arrays, at most (one slot at least)


def _aligned(shape: tuple[int, ...], dtype: mx.Dtype, nbytes: int) -> mx.array:
    """A zeroed MLX array whose data starts on a cache line where it can be placed so. The
    kernel's copy into user memory ran 3x slower here into MLX's CPU buffers, which start 24
    bytes past one (measured: preadv of page-cached blobs 1.5-2.4 GiB/s there, 4.9-5.7 GiB/s
    64-byte aligned). MLX's dimensions are 32-bit and ``as_strided`` flattens its input, so the
    shift is made in 8-byte words, over at most 2**31 of them (16 GiB a tensor): a tensor row
    that is not whole words, or a bigger array, keeps the allocator's start."""
    itemsize = nbytes // math.prod(shape)
    row = shape[-1] * itemsize
    words = nbytes // 8 + ALIGN // 8
    if row % 8 or words >= 2**31:
        arr = mx.zeros(shape, dtype)
        mx.eval(arr)
        _huge_pages(host_bytes(arr).ctypes.data, nbytes)
        return arr
    base = mx.zeros((words,), mx.uint64)
    mx.eval(base)
    addr = host_bytes(base).ctypes.data
    _huge_pages(addr, words * 8)
    word_shape = (*shape[:-1], row // 8)
    strides = [math.prod(word_shape[i + 1 :]) for i in range(len(word_shape))]
    off = (-addr % ALIGN) // 8  # MLX's buffers start on 8 bytes at least
    arr = mx.as_strided(base, word_shape, strides, off).view(mx.uint8).view(dtype)
    mx.eval(arr)  # a view: shares base's memory
    return arr


def host_bytes(arr: mx.array) -> np.ndarray:
    """A writable uint8 numpy view of an evaluated MLX array's memory (no copy; on CUDA the
    buffer moves to managed memory once, where host and device both reach it)."""
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


class PoolMemory:
    """The pool's arrays: raw slots (what reads fill), derived slots, and the kernel's view."""

    def __init__(self, spec: QuantSpec, layout: StackLayout, slots: int, backend: str) -> None:
        self.spec, self.layout, self.slots = spec, layout, slots
        self._chunk = max(1, DERIVE_CHUNK // max(1, derive_work_nbytes(spec, layout, backend)))
        self.raw: dict[Key, mx.array] = {}
        self._rows: dict[Key, np.ndarray] = {}  # uint8 [slots, tensor bytes] views of raw
        for s in layout.slots:
            self.raw[s.key], self._rows[s.key] = _slots_array(
                (slots, *s.shape), _MX_DTYPES[s.np_dtype], slots * s.nbytes)
        self.derived: dict[str, mx.array] = {}  # projection -> its derived array [slots, ...]
        self._derived_rows: dict[str, np.ndarray] = {}
        name = DERIVED.get(spec.fmt)
        if name is not None:
            for proj, arrays in finish(spec, layout, self.raw).items():
                lazy = arrays[name]
                self.derived[proj], self._derived_rows[proj] = _slots_array(
                    lazy.shape, lazy.dtype, lazy.nbytes)
        self.arrays: Arrays = self._views()

    def _views(self) -> Arrays:
        """The kernel's arrays: lazy views of the raw slots, derived ones replaced, evaluated."""
        arrays = finish(self.spec, self.layout, self.raw)
        name = DERIVED.get(self.spec.fmt)
        for proj, derived in self.derived.items():
            assert name is not None
            arrays[proj][name] = derived
        mx.eval([a for proj in arrays.values() for a in proj.values()])
        return arrays

    @staticmethod
    def slot_nbytes(spec: QuantSpec, layout: StackLayout) -> int:
        """Memory one slot takes: its bytes, and the arrays derived from them."""
        name = DERIVED.get(spec.fmt)
        if name is None:
            return layout.expert_nbytes
        one = {s.key: mx.zeros((1, *s.shape), _MX_DTYPES[s.np_dtype]) for s in layout.slots}
        derived = finish(spec, layout, one)  # lazy: only shapes and dtypes are read
        return layout.expert_nbytes + sum(a[name].nbytes for a in derived.values())

    @property
    def nbytes(self) -> int:
        raw = sum(a.nbytes for a in self.raw.values())
        return raw + sum(a.nbytes for a in self.derived.values())

    def targets(self, slot: int, expert_pieces: tuple[Piece, ...]) -> list[memoryview]:
        """Writable views, in blob order, that an expert's bytes fill to land in ``slot``."""
        return [self._rows[key][slot, :n].data for _, n, key in expert_pieces]

    def address(self, key: Key, slot: int) -> int:
        """Where ``slot`` of tensor ``key`` starts (for the GPU's copy engine)."""
        return int(self._rows[key][slot].ctypes.data)

    def fill(self, slot: int, expert_pieces: tuple[Piece, ...], blob: np.ndarray) -> None:
        """Copy a whole expert blob held in host memory into ``slot`` from the host."""
        for offset, n, key in expert_pieces:
            self._rows[key][slot, :n] = blob[offset : offset + n]

    def derive(self, slots: list[int]) -> int:
        """Compute the derived arrays of these freshly filled slots (a few at a time, so what
        is in flight stays under ``DERIVE_CHUNK``); the bytes written."""
        if not self.derived:
            return 0
        written = 0
        for i in range(0, len(slots), self._chunk):
            written += self._derive(slots[i : i + self._chunk])
        return written

    def _derive(self, slots: list[int]) -> int:
        idx = mx.array(slots)
        sub = finish(self.spec, self.layout, {k: a[idx] for k, a in self.raw.items()})
        name = DERIVED[self.spec.fmt]
        computed = {proj: sub[proj][name] for proj in self.derived}
        mx.eval(list(computed.values()))
        written = 0
        for proj, arr in computed.items():
            rows = host_bytes(arr).reshape(len(slots), -1)
            self._derived_rows[proj][slots] = rows
            written += rows.nbytes
        return written

    def swap(self, pairs: list[tuple[int, int]]) -> int:
        """Exchange the bytes (and derived arrays) of each pair of slots; the bytes written.
        No queued work may read either slot (``SlotTable.swap``'s rule)."""
        if not pairs:
            return 0
        a = [p[0] for p in pairs]
        b = [p[1] for p in pairs]
        written = 0
        for rows in [*self._rows.values(), *self._derived_rows.values()]:
            rows[a + b] = rows[b + a]  # numpy reads the right side whole before writing
            written += 2 * len(pairs) * rows.shape[1]
        return written

    def resize(self, slots: int, moves: dict[int, int], copier: Copier | None = None) -> int:
        """Give the pool ``slots`` slots, the experts of ``moves`` (old slot -> new slot, in
        order, as ``SlotTable.resize`` returns them) kept; the bytes copied. One tensor at a
        time: its new array is filled from the old one and the old one released before the
        next tensor's is made, so memory peaks at the larger of the two pools plus one tensor,
        never at both pools (a shrink comes exactly when memory is short). The kernel's arrays
        (``arrays``) are made anew: the caller must hold no other reference to the old ones
        (the bank hands its modules placeholders first). With ``copier`` (CUDA) the slots move
        by the GPU's copy engine where they live, not through the host. An exception on the way
        (an allocation refused) leaves tensors of both sizes: the caller drops the pool."""
        self.arrays = {}  # the kernel's views share the old buffers
        runs = _runs(moves)
        copied = 0
        for key in list(self.raw):
            self.raw[key], self._rows[key], n = _moved(self.raw[key], self._rows[key], slots,
                                                       runs, copier)
            mx.clear_cache()  # the old tensor, released: MLX's allocator would keep it
            copied += n
        for proj in list(self.derived):
            self.derived[proj], self._derived_rows[proj], n = _moved(
                self.derived[proj], self._derived_rows[proj], slots, runs, copier)
            mx.clear_cache()
            copied += n
        self.slots = slots
        self.arrays = self._views()
        return copied


def _slots_array(shape: tuple[int, ...], dtype: mx.Dtype,
                 nbytes: int) -> tuple[mx.array, np.ndarray]:
    """A slot array ``[slots, ...]`` (``_aligned``) and its host view, one row a slot."""
    arr = _aligned(shape, dtype, nbytes)
    return arr, host_bytes(arr).reshape(shape[0], -1)


def _runs(moves: dict[int, int]) -> list[tuple[int, int, int]]:
    """``moves`` as (old slot, new slot, count) runs of consecutive slots: one copy a run."""
    runs: list[tuple[int, int, int]] = []
    for old, new in sorted(moves.items()):
        if runs and runs[-1][0] + runs[-1][2] == old and runs[-1][1] + runs[-1][2] == new:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((old, new, 1))
    return runs


def _moved(old: mx.array, old_rows: np.ndarray, slots: int, runs: list[tuple[int, int, int]],
           copier: Copier | None) -> tuple[mx.array, np.ndarray, int]:
    """A new slot array of ``slots`` rows holding ``old``'s rows of ``runs``; the bytes copied.
    Row runs are copied as slices (a fancy index would make a temporary copy of them all)."""
    row = old_rows.shape[1]
    arr, rows = _slots_array((slots, *old.shape[1:]), old.dtype, slots * row)
    if copier is not None and copier.on:
        for o, n, k in runs:
            copier.copy(int(rows[n].ctypes.data), int(old_rows[o].ctypes.data), k * row)
        if copier.wait():
            return arr, rows, sum(k for _, _, k in runs) * row
    for o, n, k in runs:  # unified memory, or the copier gave up
        rows[n : n + k] = old_rows[o : o + k]
    return arr, rows, sum(k for _, _, k in runs) * row
