"""An ExpertSource that reads expert bytes straight from a local checkpoint (tests and benches).

Invariants:
- The bytes it returns are exactly what the daemon serves: the expert's manifest ranges
  concatenated in order, and (with ``verify``) they match the expert's xxh3-128.
- ``manifest_from_dir`` builds the same manifest shape the hub builder does (ranges are maximal
  contiguous runs in (shard order, offset) order), from files on disk; it is not the production
  builder, which hashes through the hub and checks each shard's sha256 against it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path
from types import TracebackType
from typing import Self

import xxhash

from cachecd import errors
from cachecd.manifest import (
    ByteRange,
    ExpertEntry,
    FileInfo,
    Manifest,
    TensorInfo,
    parse_expert_name,
)
from cachecd.safetensors_header import HeaderTensor, parse_header

LOCAL_REVISION = "0" * 40


def quant_format_of(config: dict) -> str:
    """The manifest's quant_format for a config.json ("none" when nothing is quantized)."""
    qc = config.get("quantization_config") or config.get("text_config", {}).get(
        "quantization_config"
    )
    if not qc:
        return "none"
    fmt = qc.get("format") if qc.get("quant_method") == "compressed-tensors" else None
    if fmt is None:
        raise errors.UnsupportedFormat(f"quantization_config {qc.get('quant_method')!r}")
    return str(fmt)


def _read_header(path: Path) -> tuple[int, list[HeaderTensor]]:
    with open(path, "rb") as f:
        first = f.read(8)
        n = int.from_bytes(first, "little")
        return parse_header(first + f.read(n), path.stat().st_size, str(path))


def _ranges(tensors: list[TensorInfo]) -> tuple[ByteRange, ...]:
    out: list[ByteRange] = []
    for t in tensors:
        if out and out[-1].file == t.file and out[-1].end == t.offset:
            out[-1] = ByteRange(t.file, out[-1].start, t.offset + t.nbytes)
        else:
            out.append(ByteRange(t.file, t.offset, t.offset + t.nbytes))
    return tuple(out)


def _expert(layer: int, expert: int, tensors: list[TensorInfo], data: bytes) -> ExpertEntry:
    offsets, pos = [], 0
    for t in tensors:
        offsets.append(pos)
        pos += t.nbytes
    return ExpertEntry(
        layer,
        expert,
        pos,
        xxhash.xxh3_128(data).digest(),
        _ranges(tensors),
        tuple(tensors),
        tuple(offsets),
    )


def manifest_from_dir(model_dir: Path, repo: str = "local/model") -> Manifest:
    """Build and validate a manifest of the checkpoint in ``model_dir`` (reads every byte once)."""
    files, resident = [], []
    grouped: dict[tuple[int, int], list[tuple[TensorInfo, bytes]]] = defaultdict(list)
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        data = path.read_bytes()
        header_len = 0
        if path.suffix == ".safetensors":
            header_len, tensors = _read_header(path)
            for h in tensors:
                chunk = data[h.start : h.end]
                info = TensorInfo(
                    h.name,
                    h.dtype,
                    h.shape,
                    path.name,
                    h.start,
                    h.nbytes,
                    xxhash.xxh3_128(chunk).digest(),
                )
                key = parse_expert_name(h.name)
                if key is None:
                    resident.append(info)
                else:
                    grouped[key].append((info, chunk))
        files.append(FileInfo(path.name, len(data), hashlib.sha256(data).hexdigest(), header_len))
    experts = [
        _expert(layer, e, [t for t, _ in parts], b"".join(c for _, c in parts))
        for (layer, e), parts in sorted(grouped.items())
    ]
    config_bytes = (model_dir / "config.json").read_bytes()
    config = json.loads(config_bytes)
    return Manifest.from_entries(
        repo=repo,
        revision=LOCAL_REVISION,
        model_type=config["model_type"],
        quant_format=quant_format_of(config),
        config_sha256=hashlib.sha256(config_bytes).hexdigest(),
        files=files,
        experts=experts,
        resident=resident,
    )


class LocalSource:
    """Reads each expert's ranges with pread from the checkpoint files; one fd per shard."""

    def __init__(self, manifest: Manifest, model_dir: Path, *, verify: bool = True) -> None:
        self.manifest = manifest
        self.model_dir = model_dir
        self.verify = verify
        self.calls: list[tuple[int, list[int]]] = []
        self.prefetched: list[tuple[int, list[int]]] = []
        self._fds: dict[str, int] = {}

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(self.model_dir / name, os.O_RDONLY)
        return fd

    def entry(self, layer: int, expert: int) -> ExpertEntry:
        return self.manifest.expert(layer, expert)

    def experts(self, layer: int, ids: list[int]) -> list[memoryview]:
        self.calls.append((layer, list(ids)))
        return [self._read(self.entry(layer, e)) for e in ids]

    def _read(self, entry: ExpertEntry) -> memoryview:
        buf = memoryview(bytearray(entry.nbytes))
        pos = 0
        for r in entry.ranges:
            got = os.preadv(self._fd(r.file), [buf[pos : pos + r.length]], r.start)
            if got != r.length:
                raise errors.ExpertSizeMismatch(f"{r.file}: short read at {r.start} ({got} bytes)")
            pos += r.length
        if self.verify and xxhash.xxh3_128(buf).digest() != entry.xxh3:
            raise errors.ChecksumMismatch(
                f"layer={entry.layer} expert={entry.expert}: bytes on disk do not match the manifest"
            )
        return buf

    def prefetch(self, layer: int, ids: list[int]) -> None:
        self.prefetched.append((layer, list(ids)))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
