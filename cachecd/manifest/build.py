"""Build a manifest from a source of repo files (a Hub endpoint, or a local folder).

One pass: read every shard's safetensors header (Range requests), plan which tensors are which
expert, then stream each shard ONCE in shard order, computing the file's sha256 and the
xxh3-128 of every tensor and of every expert on the fly (an expert split across two shards
keeps its hasher from one shard to the next). A shard whose sha256 differs from the source's
raises ``ChecksumMismatch``; no manifest is produced. Nothing holds a whole shard in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash
from tqdm import tqdm

from cachecd import constants, errors
from cachecd.manifest.entries import ByteRange, ExpertEntry, FileInfo, TensorInfo
from cachecd.manifest.manifest import Manifest, parse_expert_name
from cachecd.manifest.safetensors_header import HeaderTensor, header_length, parse_header

log = logging.getLogger(__name__)

HEAD_PROBE_BYTES = 1024 * 1024  # one Range request covers most headers (K3 shards: < 1 MiB)
INDEX_FILE = "model.safetensors.index.json"
HEX64 = re.compile(r"[0-9a-f]{64}")


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

    def stream(self, name: str) -> Iterator[bytes]: ...


Key = tuple[int, int]


@dataclass
class _Shard:
    index: int
    file: SourceFile
    header_len: int
    tensors: list[HeaderTensor]  # sorted by offset, tiling the data section


@dataclass
class _Plan:
    shards: list[_Shard]
    owner: dict[str, Key | None]  # tensor name -> (layer, expert), None for resident
    expert_tensors: dict[Key, list[tuple[str, HeaderTensor]]]  # (file, tensor) in blob order
    remaining: dict[Key, int] = field(default_factory=dict)  # tensors not yet hashed


def build_manifest(source: Source, *, progress: bool = True) -> Manifest:
    """Read, hash and assemble; the returned manifest has passed full validation."""
    files = sorted(source.list_files(), key=lambda f: f.name)
    by_name = {f.name: f for f in files}
    if "config.json" not in by_name:
        raise errors.NotFound(f"{source.repo}@{source.revision} has no config.json")
    config_bytes = _read_small(source, by_name["config.json"])
    config = _parse_config(config_bytes, source.repo)
    shard_files = _shard_files(source, files, by_name)
    plan = _plan(source, shard_files)
    total = sum(s.file.size for s in plan.shards)
    digests = _Digests()
    shas: dict[str, str] = {}
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not progress,
        desc=f"hashing {source.repo}",
        leave=False,
    ) as bar:
        hashers: dict[Key, Any] = {}
        for shard in plan.shards:
            shas[shard.file.name] = _hash_shard(source, plan, shard, hashers, digests, bar)
    infos = [_file_info(source, f, shas, config_bytes, plan) for f in files]
    return _assemble(source, config, infos, plan, digests.tensors, digests.experts, config_bytes)


# -- config and shard list --------------------------------------------------------------------
def _read_small(source: Source, f: SourceFile) -> bytes:
    data = b"".join(source.stream(f.name))
    if len(data) != f.size:
        raise errors.UpstreamError(f"{f.name}: got {len(data)} bytes, the source lists {f.size}")
    _check_sha(f, hashlib.sha256(data).hexdigest())
    return data


def _parse_config(data: bytes, repo: str) -> dict[str, Any]:
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise errors.ManifestInvalid(f"{repo}: config.json is not JSON ({exc})") from exc
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


def _shard_files(
    source: Source, files: list[SourceFile], by_name: dict[str, SourceFile]
) -> list[SourceFile]:
    """The index's shards when there is an index, else every top-level *.safetensors."""
    if INDEX_FILE not in by_name:
        return [f for f in files if f.name.endswith(".safetensors") and "/" not in f.name]
    try:
        weight_map = json.loads(_read_small(source, by_name[INDEX_FILE]))["weight_map"]
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


# -- plan --------------------------------------------------------------------------------------
def _read_header(source: Source, f: SourceFile) -> tuple[int, list[HeaderTensor]]:
    head = source.read_head(f.name, min(f.size, HEAD_PROBE_BYTES))
    n = header_length(head, f.name)
    if 8 + n > len(head):
        head = source.read_head(f.name, 8 + n)
    return parse_header(head, f.size, f.name)


def _plan(source: Source, shard_files: list[SourceFile]) -> _Plan:
    shards: list[_Shard] = []
    owner: dict[str, Key | None] = {}
    per_expert: dict[Key, list[tuple[str, HeaderTensor]]] = {}
    for i, f in enumerate(shard_files):
        n, tensors = _read_header(source, f)
        shards.append(_Shard(i, f, n, tensors))
        for t in tensors:
            if t.name in owner:
                raise errors.ManifestInvalid(f"{source.repo}: tensor {t.name} is in two shards")
            key = parse_expert_name(t.name)
            owner[t.name] = key
            if key is not None:
                per_expert.setdefault(key, []).append((f.name, t))
    remaining = {k: len(v) for k, v in per_expert.items()}
    log.info("planned repo=%s shards=%d experts=%d", source.repo, len(shards), len(per_expert))
    return _Plan(shards, owner, per_expert, remaining)


# -- hashing -----------------------------------------------------------------------------------
def _hash_shard(
    source: Source, plan: _Plan, shard: _Shard, hashers: dict[Key, Any], out: _Digests, bar: tqdm
) -> str:
    """Stream one shard (retrying a broken transfer from the start); returns its sha256."""
    if shard.file.sha256 is None and getattr(source, "requires_sha256", False):
        raise errors.UpstreamError(
            f"{shard.file.name}: the endpoint gives no sha256 (X-Linked-Etag) to check it against"
        )
    for attempt in range(constants.MAX_RETRIES + 1):
        done = 0
        try:
            p = _ShardPass(plan, shard, hashers)
            for chunk in source.stream(shard.file.name):
                p.feed(chunk)
                bar.update(len(chunk))
                done += len(chunk)
            digest = p.finish()
        except errors.UpstreamError as exc:
            bar.update(-done)
            if attempt == constants.MAX_RETRIES:
                raise
            log.warning(
                "shard_retry file=%s attempt=%d error=%s", shard.file.name, attempt + 1, exc
            )
            time.sleep(min(constants.BACKOFF_CAP_S, constants.BACKOFF_BASE_S * 2**attempt))
            continue
        _check_sha(shard.file, digest)
        p.commit(hashers, out)
        return digest
    raise AssertionError("unreachable")


@dataclass
class _Digests:
    tensors: dict[str, bytes] = field(default_factory=dict)
    experts: dict[Key, bytes] = field(default_factory=dict)


class _ShardPass:
    """One attempt at one shard. Works on copies of the carried expert hashers so a failed
    attempt leaves nothing behind; ``commit`` publishes the results."""

    def __init__(self, plan: _Plan, shard: _Shard, hashers: dict[Key, Any]) -> None:
        self.plan, self.shard = plan, shard
        self.hashers = {k: h.copy() for k, h in hashers.items()}
        self.sha = hashlib.sha256()
        self.i, self.pos, self.cur = 0, 0, xxhash.xxh3_128()
        self.remaining: dict[Key, int] = {}
        self.out = _Digests()

    def feed(self, chunk: bytes) -> None:
        self.sha.update(chunk)
        tensors, pos = self.shard.tensors, self.pos
        mv, end = memoryview(chunk), pos + len(chunk)
        while self.i < len(tensors) and tensors[self.i].start <= end:
            t = tensors[self.i]
            lo, hi = max(t.start, pos), min(t.end, end)
            key = self.plan.owner[t.name]
            if hi > lo:
                piece = mv[lo - pos : hi - pos]
                self.cur.update(piece)
                if key is not None:
                    self.hashers.setdefault(key, xxhash.xxh3_128()).update(piece)
            if t.end > end:
                break
            self._finish_tensor(t, key)
            self.i, self.cur = self.i + 1, xxhash.xxh3_128()
        self.pos = end

    def _finish_tensor(self, t: HeaderTensor, key: Key | None) -> None:
        self.out.tensors[t.name] = self.cur.digest()
        if key is None:
            return
        left = self.remaining.get(key, self.plan.remaining[key]) - 1
        self.remaining[key] = left
        if left == 0:  # the expert's last byte: free its hasher early
            self.out.experts[key] = self.hashers.pop(key, xxhash.xxh3_128()).digest()

    def finish(self) -> str:
        f = self.shard.file
        if self.pos != f.size or self.i != len(self.shard.tensors):
            raise errors.UpstreamError(f"{f.name}: stream ended at {self.pos} of {f.size} bytes")
        return self.sha.hexdigest()

    def commit(self, hashers: dict[Key, Any], out: _Digests) -> None:
        hashers.clear()
        hashers.update(self.hashers)
        self.plan.remaining.update(self.remaining)
        out.tensors.update(self.out.tensors)
        out.experts.update(self.out.experts)


def _check_sha(f: SourceFile, digest: str) -> None:
    if f.sha256 is not None and f.sha256 != digest:
        raise errors.ChecksumMismatch(
            f"{f.name}: sha256 {digest} differs from the source's {f.sha256}; "
            "the download was corrupted or the file changed: no manifest written"
        )


# -- assembly ----------------------------------------------------------------------------------
def _file_info(
    source: Source, f: SourceFile, shas: dict[str, str], config_bytes: bytes, plan: _Plan
) -> FileInfo:
    header = {s.file.name: s.header_len for s in plan.shards}
    if f.name in shas:
        sha = shas[f.name]
    elif f.name == "config.json":
        sha = hashlib.sha256(config_bytes).hexdigest()
    elif f.sha256 is not None and HEX64.fullmatch(f.sha256):
        sha = f.sha256  # a large non-shard file: the hub's own sha256 pins it
    else:
        h = hashlib.sha256()
        size = 0
        for chunk in source.stream(f.name):
            h.update(chunk)
            size += len(chunk)
        if size != f.size:
            raise errors.UpstreamError(f"{f.name}: got {size} bytes, the source lists {f.size}")
        sha = h.hexdigest()
    return FileInfo(f.name, f.size, sha, header.get(f.name, 0))


def _assemble(
    source: Source,
    config: dict[str, Any],
    infos: list[FileInfo],
    plan: _Plan,
    tensor_digests: dict[str, bytes],
    expert_digests: dict[Key, bytes],
    config_bytes: bytes,
) -> Manifest:
    resident = [
        _tensor_info(s.file.name, t, tensor_digests)
        for s in plan.shards
        for t in s.tensors
        if plan.owner[t.name] is None
    ]
    experts = [
        _expert_entry(key, parts, tensor_digests, expert_digests[key])
        for key, parts in plan.expert_tensors.items()
    ]
    return Manifest.from_entries(
        repo=source.repo,
        revision=source.revision,
        model_type=config["model_type"],
        quant_format=quant_format_of(config),
        config_sha256=hashlib.sha256(config_bytes).hexdigest(),
        files=infos,
        experts=experts,
        resident=resident,
    )


def _tensor_info(file: str, t: HeaderTensor, digests: dict[str, bytes]) -> TensorInfo:
    return TensorInfo(t.name, t.dtype, t.shape, file, t.start, t.nbytes, digests[t.name])


def _expert_entry(
    key: Key, parts: list[tuple[str, HeaderTensor]], digests: dict[str, bytes], digest: bytes
) -> ExpertEntry:
    """Tensors are already in (shard order, offset) order; ranges are their maximal runs."""
    ranges: list[ByteRange] = []
    offsets: list[int] = []
    blob = 0
    for file, t in parts:
        offsets.append(blob)
        blob += t.nbytes
        if ranges and ranges[-1].file == file and ranges[-1].end == t.start:
            ranges[-1] = ByteRange(file, ranges[-1].start, t.end)
        else:
            ranges.append(ByteRange(file, t.start, t.end))
    tensors = tuple(_tensor_info(file, t, digests) for file, t in parts)
    return ExpertEntry(key[0], key[1], blob, digest, tuple(ranges), tensors, tuple(offsets))
