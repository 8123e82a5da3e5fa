"""Build a manifest from a source of repo files (a Hub endpoint, or a local folder).

Read every shard's safetensors header (Range requests), plan which tensors are which expert
(``build_plan``), then stream each shard ONCE, ``jobs`` shards at a time, computing the file's
sha256 and the xxh3-128 of every tensor and expert on the fly (``build_shard``). A shard whose
sha256 differs from the source's raises ``ChecksumMismatch``; no manifest is produced. Nothing
holds a whole shard in memory.

Each finished shard is a durable part in the work dir (``build_parts``), so a build that stops
(an error, Ctrl-C, kill -9, a power cut) resumes with the shards not yet finished; an expert split
across shards is hashed from its parts' pieces once all are in. The result does not depend on
the order shards finish in, how often a build was resumed, or ``jobs``: the same revision gives
the same manifest, byte for byte.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash

from cachecd import constants, errors
from cachecd.manifest.build_parts import PartStore
from cachecd.manifest.build_plan import (
    HEX64,
    Key,
    Plan,
    Shard,
    Source,
    SourceFile,
    make_plan,
    parse_config,
    quant_format_of,
    read_small,
    shard_files,
)
from cachecd.manifest.build_shard import ShardResult, hash_shard
from cachecd.manifest.entries import ByteRange, ExpertEntry, FileInfo, TensorInfo
from cachecd.manifest.manifest import Manifest
from cachecd.manifest.safetensors_header import HeaderTensor

__all__ = ["HEX64", "SourceFile", "build_manifest", "build_to_file", "quant_format_of"]

log = logging.getLogger(__name__)


def build_manifest(
    source: Source,
    *,
    progress: bool | None = None,
    jobs: int = constants.MANIFEST_BUILD_JOBS,
    work_dir: Path | None = None,
    say: Callable[[str], None] | None = None,
) -> Manifest:
    """Read, hash and assemble; the returned manifest has passed full validation.

    ``work_dir`` keeps each finished shard durably (and is left for the caller to remove once
    the manifest is saved); without one a throwaway directory is used.
    """
    files = sorted(source.list_files(), key=lambda f: f.name)
    by_name = {f.name: f for f in files}
    if "config.json" not in by_name:
        raise errors.NotFound(f"{source.repo}@{source.revision} has no config.json")
    config_bytes = read_small(source, by_name["config.json"])
    config = parse_config(config_bytes, source.repo)
    shard_list = shard_files(source, files, by_name)
    with _parts(work_dir, source) as parts:
        done = {f.name: r for f in shard_list if (r := parts.load(f)) is not None}
        plan = make_plan(source, shard_list, {name: r.header for name, r in done.items()})
        if done and say is not None:
            size = sum(r.size for r in done.values())
            say(f"resuming: {len(done)} of {len(plan.shards)} shards already hashed "
                f"({size / 1e9:.2f} GB) in {parts.root}")
        results = _hash_all(source, plan, parts, done, max(1, jobs), progress)
        tensors, experts = _combine(plan, results, parts)
    shas = {name: r.sha256 for name, r in results.items()}
    infos = [_file_info(source, f, shas, config_bytes, plan) for f in files]
    return _assemble(source, config, infos, plan, tensors, experts, config_bytes)


def build_to_file(
    source: Source,
    output: Path,
    *,
    progress: bool | None = None,
    jobs: int = constants.MANIFEST_BUILD_JOBS,
    work_dir: Path | None = None,
    say: Callable[[str], None] | None = None,
) -> Manifest:
    """Build (resuming from ``work_dir``, by default ``OUTPUT.parts`` beside the output), save
    durably, then remove the work dir."""
    work = work_dir or output.with_name(output.name + ".parts")
    manifest = build_manifest(source, progress=progress, jobs=jobs, work_dir=work, say=say)
    manifest.save(output)
    PartStore(work, source.repo, source.revision).remove()
    return manifest


@contextmanager
def _parts(work_dir: Path | None, source: Source) -> Iterator[PartStore]:
    if work_dir is not None:
        yield PartStore(work_dir, source.repo, source.revision)
        return
    with tempfile.TemporaryDirectory(prefix="cachecd-manifest-") as tmp:
        yield PartStore(Path(tmp), source.repo, source.revision, durable=False)


# -- hashing -----------------------------------------------------------------------------------
def _hash_all(
    source: Source, plan: Plan, parts: PartStore, done: dict[str, ShardResult], jobs: int,
    progress: bool | None,
) -> dict[str, ShardResult]:
    """Every shard's result: the finished parts, and the rest hashed ``jobs`` at a time."""
    from huggingface_hub.utils import tqdm  # honours HF_HUB_DISABLE_PROGRESS_BARS

    results = dict(done)
    pending = [s for s in plan.shards if s.file.name not in done]
    total = sum(s.file.size for s in plan.shards)
    initial = sum(r.size for r in done.values())
    stop, lock = threading.Event(), threading.Lock()
    with tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024,
              # None: a bar on a terminal only (tqdm's rule), never into a file or a pipe.
              disable=None if progress is None else not progress, desc=f"hashing {source.repo}",
              leave=False) as bar:

        def advance(n: int) -> None:
            with lock:
                bar.update(n)

        def work(shard: Shard) -> ShardResult:
            return parts.save(hash_shard(source, plan, shard, advance, stop))

        bar.set_postfix_str(f"{len(results)}/{len(plan.shards)} shards")
        with ThreadPoolExecutor(max_workers=min(jobs, max(1, len(pending)))) as pool:
            futures = [pool.submit(work, s) for s in pending]
            try:
                for fut in as_completed(futures):
                    r = fut.result()
                    results[r.file] = r
                    log.debug("shard_hashed file=%s done=%d/%d", r.file, len(results),
                             len(plan.shards))
                    bar.set_postfix_str(f"{len(results)}/{len(plan.shards)} shards")
            except BaseException:
                stop.set()  # the others stop at their next chunk; their parts stay unwritten
                for fut in futures:
                    fut.cancel()
                raise
    return results


def _combine(
    plan: Plan, results: dict[str, ShardResult], parts: PartStore
) -> tuple[dict[str, bytes], dict[Key, bytes]]:
    """Tensor and expert digests of the whole revision; split experts hashed from their pieces,
    each piece checked tensor by tensor against the digests its shard's pass computed."""
    tensors: dict[str, bytes] = {}
    experts: dict[Key, bytes] = {}
    for s in plan.shards:
        r = results[s.file.name]
        if len(r.tensors) != len(s.tensors):
            raise errors.ManifestInvalid(
                f"{s.file.name}: its part has {len(r.tensors)} tensor digests, the header "
                f"{len(s.tensors)}; remove the work dir {parts.root} and build again"
            )
        tensors.update(zip((t.name for t in s.tensors), r.tensors, strict=True))
        experts.update(r.experts)
    for key in sorted(plan.split):
        h = xxhash.xxh3_128()
        by_file: dict[str, list[HeaderTensor]] = {}
        for file, t in plan.expert_tensors[key]:
            by_file.setdefault(file, []).append(t)
        for file, ts in by_file.items():
            piece = parts.piece(results[file], results[file].pieces[key])
            _check_piece(file, piece, ts, tensors, parts.root)
            h.update(piece)
        experts[key] = h.digest()
    return tensors, experts


def _check_piece(
    file: str, piece: bytes, ts: list[HeaderTensor], digests: dict[str, bytes], root: Path
) -> None:
    pos = 0
    for t in ts:
        if xxhash.xxh3_128(piece[pos : pos + t.nbytes]).digest() != digests[t.name]:
            raise errors.ChecksumMismatch(
                f"{file}: the work dir's bytes of {t.name} differ from its hash; remove the work "
                f"dir {root} and build again"
            )
        pos += t.nbytes
    if pos != len(piece):
        raise errors.ChecksumMismatch(f"{file}: a piece in the work dir {root} has the wrong size")


# -- assembly ----------------------------------------------------------------------------------
def _file_info(
    source: Source, f: SourceFile, shas: dict[str, str], config_bytes: bytes, plan: Plan
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
    plan: Plan,
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
        made="full-pass",
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
