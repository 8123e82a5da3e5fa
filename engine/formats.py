"""Expert bytes -> mx arrays, one decoder per quant format.

Invariants:
- The layout of an expert's bytes comes only from its manifest entry (``tensors`` and
  ``blob_offsets``): the bytes are the expert's tensors as they lie in the checkpoint, in order.
- A decoded expert holds, per projection (``gate_proj``/``up_proj``/``down_proj``), exactly the
  arrays mlx-lm's ``sanitize`` puts in that expert's row of the resident stack: same dtype, same
  shape, same bytes. So a stack of decoded experts equals a selection of rows of the resident
  stack, which is what makes the streamed bank bit-identical.
- One copy per tensor: numpy views over the buffer, then one copy into mx.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from cachecd import errors

# Checkpoint projection names -> mlx-lm's SwitchGLU attribute names (kimi_k3 / deepseek_v3 sanitize).
PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_SUFFIX_RE = re.compile(r"\.experts\.\d+\.(w[123]|gate_proj|up_proj|down_proj)\.(\w+)$")

# numpy has no bfloat16: read its bits as uint16 and reinterpret in mx.
_NP_DTYPES: dict[str, type[np.generic]] = {
    "U8": np.uint8,
    "I8": np.int8,
    "I32": np.int32,
    "U32": np.uint32,
    "F16": np.float16,
    "BF16": np.uint16,
    "F32": np.float32,
}


class TensorLayout(Protocol):
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class ExpertLayout(Protocol):
    """The part of ``cachecd.manifest.ExpertEntry`` the decoders read."""

    @property
    def nbytes(self) -> int: ...
    @property
    def tensors(self) -> Sequence[TensorLayout]: ...
    @property
    def blob_offsets(self) -> Sequence[int]: ...


Buffer = bytes | bytearray | memoryview | np.ndarray  # anything exposing contiguous bytes
Arrays = dict[str, dict[str, mx.array]]  # projection -> {"weight"/"scales"/"biases": array}
Raw = dict[tuple[str, str], "np.ndarray | mx.array"]  # (projection, checkpoint suffix) -> tensor


@dataclass(frozen=True)
class QuantSpec:
    """How the bank computes: the mlx quantization of the expert stacks (mode None: unquantized)."""

    fmt: str
    mode: str | None = None
    group_size: int = 0
    bits: int = 0


# The mapping mlx-lm applies to compressed-tensors configs; "none" is a plain float stack.
QUANT_SPECS = {
    "mxfp4-pack-quantized": QuantSpec("mxfp4-pack-quantized", "mxfp4", 32, 4),
    "pack-quantized": QuantSpec("pack-quantized", "affine", 32, 4),
    "none": QuantSpec("none"),
}


def quant_spec(fmt: str) -> QuantSpec:
    spec = QUANT_SPECS.get(fmt)
    if spec is None:
        raise errors.UnsupportedFormat(
            f"quant format {fmt!r} has no expert decoder; supported: {sorted(QUANT_SPECS)}"
        )
    return spec


@dataclass(frozen=True)
class DecodedExpert:
    arrays: Arrays
    nbytes: int  # bytes held by the arrays (what the RAM tier budgets)


def _to_mx(view: np.ndarray, dtype: str) -> mx.array:
    arr = mx.array(view)
    return arr.view(mx.bfloat16) if dtype == "BF16" else arr


def tensor_views(entry: ExpertLayout, buf: Buffer) -> Raw:
    """Split an expert's bytes into its tensors, keyed by (projection, checkpoint suffix)."""
    # Any contiguous buffer: bytes, mmap, a numpy array from the daemon client.
    mv = (buf.data if isinstance(buf, np.ndarray) else memoryview(buf)).cast("B")
    if mv.nbytes != entry.nbytes:
        raise errors.ExpertSizeMismatch(
            f"expert buffer has {mv.nbytes} bytes, its manifest entry says {entry.nbytes}"
        )
    out: Raw = {}
    for tensor, offset in zip(entry.tensors, entry.blob_offsets, strict=True):
        m = _SUFFIX_RE.search(tensor.name)
        np_dtype = _NP_DTYPES.get(tensor.dtype)
        if m is None or np_dtype is None:
            raise errors.UnsupportedFormat(
                f"expert tensor {tensor.name!r} ({tensor.dtype}) is not a known expert tensor"
            )
        count = tensor.nbytes // np.dtype(np_dtype).itemsize
        view = np.frombuffer(mv, dtype=np_dtype, count=count, offset=offset)
        proj = PROJECTIONS.get(m.group(1), m.group(1))
        out[(proj, m.group(2))] = _to_mx(view.reshape(tensor.shape), tensor.dtype)
    return out


def _need(raw: Raw, proj: str, suffix: str) -> mx.array:
    arr = raw.get((proj, suffix))
    if arr is None:
        raise errors.UnsupportedFormat(f"expert has no {proj}.{suffix} tensor")
    assert isinstance(arr, mx.array)
    return arr


def _mxfp4(raw: Raw) -> Arrays:
    # Packed U8 [out, in/2] is the uint32 [out, in/8] mlx wants; e8m0 scales stay uint8.
    return {
        p: {
            "weight": _need(raw, p, "weight_packed").view(mx.uint32),
            "scales": _need(raw, p, "weight_scale"),
        }
        for p in PROJECTIONS.values()
    }


def _int4_symmetric(raw: Raw) -> Arrays:
    # compressed-tensors int4 is symmetric around 8: mlx's affine form needs biases = -8 * scales.
    out: Arrays = {}
    for p in PROJECTIONS.values():
        scales = _need(raw, p, "weight_scale")
        out[p] = {
            "weight": _need(raw, p, "weight_packed").view(mx.uint32),
            "scales": scales,
            "biases": -8 * scales,
        }
    return out


def _plain(raw: Raw) -> Arrays:
    return {p: {"weight": _need(raw, p, "weight")} for p in PROJECTIONS.values()}


_DECODERS: dict[str, Callable[[Raw], Arrays]] = {
    "mxfp4-pack-quantized": _mxfp4,
    "pack-quantized": _int4_symmetric,
    "none": _plain,
}


def decode_expert(spec: QuantSpec, entry: ExpertLayout, buf: Buffer) -> DecodedExpert:
    """Decode one expert's bytes; the arrays are materialized, so ``buf`` may be reused after."""
    arrays = _DECODERS[spec.fmt](tensor_views(entry, buf))
    flat = [a for proj in arrays.values() for a in proj.values()]
    mx.eval(flat)
    return DecodedExpert(arrays, sum(a.nbytes for a in flat))


def stack_experts(experts: Sequence[DecodedExpert]) -> Arrays:
    """One stack per projection array, rows in the given order: the shrunk weight bank."""
    first = experts[0].arrays
    return {
        proj: {name: mx.stack([e.arrays[proj][name] for e in experts]) for name in names}
        for proj, names in first.items()
    }
