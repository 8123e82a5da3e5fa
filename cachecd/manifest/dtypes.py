"""Safetensors dtypes: the one table of what each one is, shared by the manifest (sizes), the
engine (how an expert's bytes are held in numpy and MLX) and the testbed (how the tiny models
are written). A new dtype is one row here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    bits: int  # per element (sub-byte float types pack)
    numpy: str | None  # the numpy dtype its bytes are held as (bf16 as its uint16 bits, fp8 as
    #                    bytes); None: numpy cannot hold it
    mlx: str | None  # the mlx.core dtype ``mx.load`` returns for it (fp8 as uint8); None: none
    writer: str | None = None  # the dtype name safetensors' own writer takes (``TensorSpec``)

    @property
    def itemsize(self) -> int:
        return self.bits // 8


DTYPES: dict[str, DType] = {
    "BOOL": DType(8, "bool", "bool_", "bool"),
    "U8": DType(8, "uint8", "uint8", "uint8"),
    "I8": DType(8, "int8", "int8", "int8"),
    "F8_E5M2": DType(8, "uint8", "uint8", "float8_e5m2"),
    "F8_E4M3": DType(8, "uint8", "uint8", "float8_e4m3fn"),
    "F8_E8M0": DType(8, "uint8", "uint8"),
    "I16": DType(16, "int16", "int16", "int16"),
    "U16": DType(16, "uint16", "uint16", "uint16"),
    "F16": DType(16, "float16", "float16", "float16"),
    "BF16": DType(16, "uint16", "bfloat16", "bfloat16"),
    "I32": DType(32, "int32", "int32", "int32"),
    "U32": DType(32, "uint32", "uint32", "uint32"),
    "F32": DType(32, "float32", "float32", "float32"),
    "I64": DType(64, "int64", "int64", "int64"),
    "U64": DType(64, "uint64", "uint64", "uint64"),
    "F64": DType(64, "float64", None, "float64"),
    "C64": DType(64, "complex64", None),
    "F4": DType(4, None, None),
    "F6_E2M3": DType(6, None, None),
    "F6_E3M2": DType(6, None, None),
}
# Bits per element of each safetensors dtype.
DTYPE_BITS: dict[str, int] = {name: d.bits for name, d in DTYPES.items()}


def writer_name(name: str) -> str:
    """The dtype name safetensors' writer takes for ``name`` (ValueError: it writes none)."""
    writer = DTYPES[name].writer
    if writer is None:
        raise ValueError(f"safetensors' writer takes no {name} tensors")
    return writer
