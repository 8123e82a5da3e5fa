"""Expert bytes -> the arrays mlx-lm's expert bank computes from, one rule per quant format.

Invariants:
- The layout of an expert's bytes comes only from its manifest entry (``tensors`` and
  ``blob_offsets``): the bytes are the expert's tensors as they lie in the checkpoint, in order.
- Every expert of a model has the same tensors (name suffix, dtype, shape); ``StackLayout``
  names them once, and ``pieces`` maps one expert's blob onto them, refusing an expert that
  differs. A stack of ``n`` experts holds, per tensor, an array ``[n, *shape]`` of its raw storage
  dtype, so expert bytes can be read straight into the stack.
- ``finish`` turns raw stacks into exactly the arrays mlx-lm's ``sanitize`` puts in the resident
  stack (same dtype, same shape, same bytes, row for row): reinterpreting views, for int4 the
  biases mlx derives from the scales, and for fp8 the bf16 weights mlx-lm dequantizes to, each
  computed with sanitize's own ops over the same values (elementwise, so a stack's rows are the
  experts' own results).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from cachecd import errors
from cachecd.manifest.dtypes import DTYPES

# Checkpoint projection names -> mlx-lm's SwitchGLU attribute names (kimi_k3 / deepseek_v3 sanitize).
PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_SUFFIX_RE = re.compile(r"\.experts\.\d+\.(w[123]|gate_proj|up_proj|down_proj)\.(\w+)$")

# The dtypes an expert's tensors may have; how each is held is the shared table's
# (``cachecd.manifest.dtypes``: bfloat16 as its uint16 bits, fp8 as its bytes, each reinterpreted
# in mx; mx.load reads F8_E4M3 as uint8 too).
_EXPERT_DTYPES = frozenset({"U8", "F8_E4M3", "I8", "I32", "U32", "F16", "BF16", "F32"})

Key = tuple[str, str]  # (projection, checkpoint suffix), e.g. ("gate_proj", "weight_packed")
Arrays = dict[str, dict[str, mx.array]]  # projection -> {"weight"/"scales"/"biases": array}


class TensorLayout(Protocol):
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class ExpertLayout(Protocol):
    """The part of ``cachecd.manifest.entries.ExpertEntry`` the engine reads."""

    @property
    def nbytes(self) -> int: ...
    @property
    def tensors(self) -> Sequence[TensorLayout]: ...
    @property
    def blob_offsets(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class QuantSpec:
    """How the bank computes: the mlx quantization of the expert stacks (mode None: unquantized)."""

    fmt: str
    mode: str | None = None
    group_size: int = 0
    bits: int = 0


# The mapping mlx-lm applies to compressed-tensors configs; "none" is a plain float stack, and
# "fp8" (128x128 block scales) one too: mlx-lm's sanitize dequantizes it to bf16 and keeps it so.
QUANT_SPECS = {
    "mxfp4-pack-quantized": QuantSpec("mxfp4-pack-quantized", "mxfp4", 32, 4),
    "pack-quantized": QuantSpec("pack-quantized", "affine", 32, 4),
    "fp8": QuantSpec("fp8"),
    "none": QuantSpec("none"),
}
# mlx-lm's deepseek_v3 sanitize dequantizes fp8 in 128x128 blocks whatever weight_block_size says.
FP8_BLOCK = 128
# Bytes per weight element of an fp8 stack, besides its own byte, while finish computes from it:
# the bf16 decode, its padded copy, the fp32 product and the bf16 result (measured: all alive
# until the result is done, 10 bytes), and on the CPU room for gather_mm's fp32 copy.
_FP8_WORK = {"cpu": 14, "gpu": 10}


def quant_spec(fmt: str) -> QuantSpec:
    spec = QUANT_SPECS.get(fmt)
    if spec is None:
        raise errors.UnsupportedFormat(
            f"quant format {fmt!r} has no expert decoder; supported: {sorted(QUANT_SPECS)}"
        )
    return spec


@dataclass(frozen=True)
class TensorSlot:
    """One tensor every expert has, as the stack stores it."""

    key: Key
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype].numpy)


@dataclass(frozen=True)
class StackLayout:
    slots: tuple[TensorSlot, ...]  # sorted by key
    expert_nbytes: int

    @classmethod
    def of(cls, entry: ExpertLayout) -> StackLayout:
        slots = sorted((_slot(t) for t in entry.tensors), key=lambda s: s.key)
        if len({s.key for s in slots}) != len(slots):
            raise errors.UnsupportedFormat("an expert names the same tensor twice")
        return cls(tuple(slots), entry.nbytes)


def _slot(t: TensorLayout) -> TensorSlot:
    m = _SUFFIX_RE.search(t.name)
    if m is None or t.dtype not in _EXPERT_DTYPES:
        raise errors.UnsupportedFormat(
            f"expert tensor {t.name!r} ({t.dtype}) is not a known expert tensor"
        )
    key = (PROJECTIONS.get(m.group(1), m.group(1)), m.group(2))
    return TensorSlot(key, t.dtype, tuple(t.shape), t.nbytes)


Piece = tuple[int, int, Key]  # (offset in the expert's blob, bytes, tensor)


def pieces(entry: ExpertLayout, layout: StackLayout) -> tuple[Piece, ...]:
    """The expert's blob as consecutive tensors of ``layout`` (every byte covered exactly once)."""
    by_key = {s.key: s for s in layout.slots}
    out: list[Piece] = []
    for tensor, offset in zip(entry.tensors, entry.blob_offsets, strict=True):
        slot = _slot(tensor)
        if by_key.get(slot.key) != slot:
            raise errors.UnsupportedFormat(
                f"expert tensor {tensor.name!r} {tensor.dtype}{list(tensor.shape)} differs from "
                f"the other experts of the model"
            )
        out.append((offset, tensor.nbytes, slot.key))
    out.sort()
    pos = 0
    for offset, nbytes, _ in out:
        if offset != pos:
            raise errors.UnsupportedFormat(f"expert tensors leave a gap or overlap at byte {pos}")
        pos += nbytes
    if pos != entry.nbytes or len(out) != len(layout.slots):
        raise errors.ExpertSizeMismatch(
            f"expert tensors cover {pos} bytes, its manifest entry says {entry.nbytes}"
        )
    return tuple(out)


Raw = Mapping[Key, mx.array]  # tensor -> its stack [n, *shape] in the storage dtype


def _need(raw: Raw, proj: str, suffix: str, dtype: str) -> mx.array:
    arr = raw.get((proj, suffix))
    if arr is None:
        raise errors.UnsupportedFormat(f"expert has no {proj}.{suffix} tensor")
    return arr.view(mx.bfloat16) if dtype == "BF16" else arr


def _mxfp4(raw: Raw, dtypes: Mapping[Key, str]) -> Arrays:
    # Packed U8 [out, in/2] is the uint32 [out, in/8] mlx wants; e8m0 scales stay uint8.
    out: Arrays = {}
    for p in PROJECTIONS.values():
        w = _need(raw, p, "weight_packed", dtypes.get((p, "weight_packed"), "U8"))
        out[p] = {
            "weight": w.view(mx.uint32),
            "scales": _need(raw, p, "weight_scale", dtypes.get((p, "weight_scale"), "U8")),
        }
    return out


def _int4_symmetric(raw: Raw, dtypes: Mapping[Key, str]) -> Arrays:
    # compressed-tensors int4 is symmetric around 8: mlx's affine form needs biases = -8 * scales.
    out: Arrays = {}
    for p in PROJECTIONS.values():
        scales = _need(raw, p, "weight_scale", dtypes.get((p, "weight_scale"), "BF16"))
        w = _need(raw, p, "weight_packed", dtypes.get((p, "weight_packed"), "U8"))
        out[p] = {"weight": w.view(mx.uint32), "scales": scales, "biases": -8 * scales}
    return out


def _fp8_block(raw: Raw, dtypes: Mapping[Key, str]) -> Arrays:
    out: Arrays = {}
    for p in PROJECTIONS.values():
        w = _need(raw, p, "weight", dtypes.get((p, "weight"), "F8_E4M3"))
        s = _need(raw, p, "weight_scale_inv", dtypes.get((p, "weight_scale_inv"), "F32"))
        out[p] = {"weight": dequantize_fp8(w, s)}
    return out


def dequantize_fp8(weight: mx.array, scale_inv: mx.array) -> mx.array:
    """mlx-lm's sanitize ``dequant``, op for op, over a stack ``[n, m, k]`` of fp8 bytes and its
    block scales ``[n, ceil(m/128), ceil(k/128)]``: every op is elementwise or a reshape, so row
    ``e`` is bitwise what sanitize computes for expert ``e`` alone."""
    weight = mx.from_fp8(weight, dtype=mx.bfloat16)
    bs = FP8_BLOCK
    n, m, k = weight.shape
    pad_bottom, pad_side = (-m) % bs, (-k) % bs
    weight = mx.pad(weight, [(0, 0), (0, pad_bottom), (0, pad_side)])
    weight = weight.reshape((n, (m + pad_bottom) // bs, bs, (k + pad_side) // bs, bs))
    weight = (weight * scale_inv[:, :, None, :, None]).reshape(n, m + pad_bottom, k + pad_side)
    return weight[:, :m, :k].astype(mx.bfloat16)


def _plain(raw: Raw, dtypes: Mapping[Key, str]) -> Arrays:
    return {
        p: {"weight": _need(raw, p, "weight", dtypes.get((p, "weight"), "F32"))}
        for p in PROJECTIONS.values()
    }


_FINISH: dict[str, Callable[[Raw, Mapping[Key, str]], Arrays]] = {
    "mxfp4-pack-quantized": _mxfp4,
    "pack-quantized": _int4_symmetric,
    "fp8": _fp8_block,
    "none": _plain,
}


def derive_work_nbytes(spec: QuantSpec, layout: StackLayout, backend: str) -> int:
    """Memory in flight while ``finish`` computes one expert's derived arrays (the pool keeps
    the result): for fp8 the bf16 decode and its way there, for int4 the biases; 0 for formats
    whose arrays are views of the bytes."""
    if spec.fmt == "fp8":
        weights = sum(math.prod(s.shape) for s in layout.slots if s.key[1] == "weight")
        return weights * _FP8_WORK["cpu" if backend == "cpu" else "gpu"]
    if spec.fmt == "pack-quantized":
        return 2 * sum(s.nbytes for s in layout.slots if s.key[1] == "weight_scale")
    return 0


def finish(spec: QuantSpec, layout: StackLayout, raw: Raw) -> Arrays:
    """The projection arrays of a stack, from its raw tensor stacks (lazy: views, no copy, except
    fp8, whose bf16 weights are computed from the raw stack when the kernel runs)."""
    return _FINISH[spec.fmt](raw, {s.key: s.dtype for s in layout.slots})


def stack_from_blobs(
    spec: QuantSpec, entries: Sequence[ExpertLayout], blobs: Sequence[bytes | memoryview]
) -> Arrays:
    """The stack of these experts from whole blobs (tests and tools; the engine reads in place)."""
    layout = StackLayout.of(entries[0])
    raw: dict[Key, list[np.ndarray]] = {s.key: [] for s in layout.slots}
    slots = {s.key: s for s in layout.slots}
    for entry, blob in zip(entries, blobs, strict=True):
        mv = memoryview(blob).cast("B")
        if mv.nbytes != entry.nbytes:
            raise errors.ExpertSizeMismatch(
                f"expert buffer has {mv.nbytes} bytes, its manifest entry says {entry.nbytes}"
            )
        for offset, nbytes, key in pieces(entry, layout):
            s = slots[key]
            raw[key].append(np.frombuffer(mv[offset : offset + nbytes], s.np_dtype).reshape(s.shape))
    stacks = {k: mx.array(np.stack(v)) for k, v in raw.items()}
    return finish(spec, layout, stacks)
