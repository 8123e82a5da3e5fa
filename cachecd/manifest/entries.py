"""The rows of a manifest: the files, tensors, byte ranges and experts it names.

Plain frozen values. The ``Manifest`` hands them out and takes them in (``from_entries``), the
builder makes them, the encoder turns them into columns; nothing here validates (the ``Manifest``
built from them does).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FileInfo:
    name: str
    size: int
    sha256: str
    header_len: int  # safetensors JSON header length (data starts at 8 + header_len); 0 otherwise


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int  # absolute offset of the tensor's data in `file`
    nbytes: int
    xxh3: bytes  # 16-byte xxh3-128 digest of the tensor's bytes


@dataclass(frozen=True)
class ByteRange:
    file: str
    start: int  # absolute, inclusive
    end: int  # absolute, exclusive

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ExpertEntry:
    layer: int
    expert: int
    nbytes: int
    xxh3: bytes
    ranges: tuple[ByteRange, ...]
    tensors: tuple[TensorInfo, ...]  # in the order their bytes appear in the expert's bytes
    blob_offsets: tuple[int, ...]  # offset of each tensor inside the expert's bytes
    # Its source key (``provenance.source_key``): which shard's bytes, where. The manifest sets
    # it; entries made elsewhere (the builder, tests) have "" and never match a cached blob.
    source: str = field(default="", compare=False)

    @property
    def digest_hex(self) -> str:
        return self.xxh3.hex()
