"""What a manifest build reads, and the plan made from the shards' safetensors headers.

A ``Source`` lists the revision's files (with the sha256 it vouches for, when it has one) and
streams their bytes from any offset. The plan says, from the headers alone, which tensor belongs
to which routed expert (or to none: resident) and which experts HF sharding split across shards:
those are the only ones whose hash needs bytes from more than one shard.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cachecd import errors
from cachecd.manifest import bounds
from cachecd.manifest.manifest import parse_expert_name
from cachecd.manifest.safetensors_header import HeaderTensor, header_length, parse_header

log = logging.getLogger(__name__)

HEAD_PROBE_BYTES = 1024 * 1024  # one Range request covers most headers (K3 shards: < 1 MiB)
INDEX_FILE = "model.safetensors.index.json"
HEX64 = re.compile(r"[0-9a-f]{64}")

Key = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class SourceFile:
    name: str
    size: int
    sha256: str | None  # what the source vouches for (hub X-Linked-Etag / LFS oid); None: unknown


class Source(Protocol):
    """Where the repo's bytes come from. ``revision`` is the resolved 40-hex commit."""

    repo: str
    revision: str

    def list_files(self) -> list[SourceFile]: ...

    def read_head(self, name: str, nbytes: int) -> bytes: ...

    def stream(self, name: str, start: int = 0) -> Iterator[bytes]: ...


@dataclass
class Shard:
    index: int
    file: SourceFile
    header: bytes  # the first 8 + N bytes of the file, as the plan was made from them
    tensors: list[HeaderTensor]  # sorted by offset, tiling the data section

    @property
    def header_len(self) -> int:
        return len(self.header) - 8


@dataclass
class Plan:
    shards: list[Shard]
    owner: dict[str, Key | None]  # tensor name -> (layer, expert), None for resident
    expert_tensors: dict[Key, list[tuple[str, HeaderTensor]]]  # (file, tensor) in blob order
    split: set[Key]  # experts with tensors in more than one shard


# -- config and shard list --------------------------------------------------------------------
def read_small(source: Source, f: SourceFile) -> bytes:
    data = b"".join(source.stream(f.name))
    if len(data) != f.size:
        raise errors.UpstreamError(f"{f.name}: got {len(data)} bytes, the source lists {f.size}")
    check_sha(f, hashlib.sha256(data).hexdigest())
    return data


def parse_config(data: bytes, repo: str) -> dict[str, Any]:
    config = bounds.loads(data, repo, "config.json")
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise errors.ManifestInvalid(f"{repo}: config.json has no model_type")
    return config


def quant_format_of(config: dict[str, Any]) -> str:
    """ "mxfp4-pack-quantized", "pack-quantized", "fp8", ... from the quantization_config;
    "none" without one."""
    text = config.get("text_config")
    qc = config.get("quantization_config") or (
        text.get("quantization_config") if isinstance(text, dict) else None
    )
    if not isinstance(qc, dict):
        return "none"
    if qc.get("quant_method") == "fp8" and qc.get("scale_fmt") == "ue8m0" and list(
        qc.get("weight_block_size") or ()
    ) == [32, 32]:
        return "mxfp8"  # mlx-lm keeps these packed (mxfp8), unlike fp8 it dequantizes to bf16
    fmt = qc.get("format")
    if not fmt and isinstance(qc.get("config_groups"), dict):
        formats = {g.get("format") for g in qc["config_groups"].values() if isinstance(g, dict)}
        formats.discard(None)
        fmt = formats.pop() if len(formats) == 1 else None
    return str(fmt or qc.get("quant_method") or "unknown")


def shard_files(
    source: Source, files: list[SourceFile], by_name: dict[str, SourceFile]
) -> list[SourceFile]:
    """The index's shards when there is an index, else every top-level *.safetensors."""
    if INDEX_FILE not in by_name:
        return [f for f in files if f.name.endswith(".safetensors") and "/" not in f.name]
    try:
        weight_map = bounds.loads(read_small(source, by_name[INDEX_FILE]), source.repo,
                                  INDEX_FILE)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (KeyError, TypeError, ValueError) as exc:
        raise errors.ManifestInvalid(
            f"{source.repo}: {INDEX_FILE} has no usable weight_map"
        ) from exc
    missing = [n for n in names if n not in by_name]
    if missing:
        raise errors.ManifestInvalid(
            f"{source.repo}: {INDEX_FILE} names missing shard {missing[0]}"
        )
    return [by_name[n] for n in names]


def check_sha(f: SourceFile, digest: str) -> None:
    if f.sha256 is not None and f.sha256 != digest:
        raise errors.ChecksumMismatch(
            f"{f.name}: sha256 {digest} differs from the source's {f.sha256}; "
            "the download was corrupted or the file changed: no manifest written"
        )


# -- plan --------------------------------------------------------------------------------------
def read_header(source: Source, f: SourceFile) -> bytes:
    """The shard's first 8 + N bytes (one Range request, two for a header past the probe)."""
    head = source.read_head(f.name, min(f.size, HEAD_PROBE_BYTES))
    n = header_length(head, f.name)
    if 8 + n > len(head):
        head = source.read_head(f.name, 8 + n)
    return bytes(head[: 8 + n])


def make_plan(source: Source, files: list[SourceFile], known: Mapping[str, bytes]) -> Plan:
    """The plan, reading the header of every shard whose header ``known`` does not hold."""
    shards: list[Shard] = []
    owner: dict[str, Key | None] = {}
    per_expert: dict[Key, list[tuple[str, HeaderTensor]]] = {}
    in_shards: dict[Key, set[int]] = {}
    for i, f in enumerate(files):
        head = known.get(f.name) or read_header(source, f)
        _, tensors = parse_header(head, f.size, f.name)
        shards.append(Shard(i, f, head, tensors))
        for t in tensors:
            if t.name in owner:
                raise errors.ManifestInvalid(f"{source.repo}: tensor {t.name} is in two shards")
            key = parse_expert_name(t.name)
            owner[t.name] = key
            if key is not None:
                per_expert.setdefault(key, []).append((f.name, t))
                in_shards.setdefault(key, set()).add(i)
    split = {k for k, where in in_shards.items() if len(where) > 1}
    log.info("planned repo=%s shards=%d experts=%d split=%d", source.repo, len(shards),
             len(per_expert), len(split))
    return Plan(shards, owner, per_expert, split)
