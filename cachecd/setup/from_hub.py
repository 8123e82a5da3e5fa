"""``setup --stream ORG/NAME`` with no manifest: the expert map from the shards' own headers, every
byte of them proven through Xet, and the small files against the commit's tree.

The Hub's answers over TLS at the pinned commit are what is trusted, as for the bytes themselves:
its tree (each file's size, its git blob id where git keeps it, its LFS sha256 and Xet hash where
not) and its content store's proofs. Per shard, the first 8 + N bytes (the safetensors header) are
read through the daemon's own Xet route (``xet_source``): their window's chunk hashes, merged with
the proof's gaps, must give the shard's ``X-Xet-Hash`` at the commit, else nothing of them is used.
Config, tokenizer and every other file outside LFS are downloaded and their git blob id compared
with the tree's ``oid`` (an LFS one's sha256 with the tree's). So the manifest made here holds no
byte the Hub did not vouch for, and no digest at all: the daemon learns each expert's from its
proven bytes on its first fetch, setup each resident tensor's (``resident``).

A repo whose shards are not all in Xet cannot be proven this way: ``None``, and setup asks for a
manifest as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachecd.errors import ChecksumMismatch, ManifestInvalid, XetProofError
from cachecd.manifest.build_plan import SourceFile, make_plan, parse_config, shard_files
from cachecd.manifest.entries import FileInfo
from cachecd.manifest.from_headers import manifest_from_plan
from cachecd.manifest.manifest import Manifest
from cachecd.manifest.safetensors_header import header_length
from cachecd.manifest.sha256 import git_blob_id
from cachecd.upstream.xet_cache import ChunkCache

log = logging.getLogger(__name__)

FIRST_READ = 64 * 1024  # about one chunk: the proof's window is at least that anyway
# Setup's proven chunks, shared by its header reads and its resident reads (two event loops, one
# process): the resident tensors next to a header are not read again.
KEPT = ChunkCache()


@dataclass
class Pin:
    """What the upstream asks of a manifest to read a file at a commit (repo, revision, sizes)."""

    repo: str
    revision: str
    files: dict[str, FileInfo] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.repo}@{self.revision}"

    @property
    def source(self) -> str:
        return f"the Hub's tree of {self.key}"


class _Proven:
    """A ``build_plan.Source`` over bytes already checked: the small files, read from disk."""

    def __init__(self, repo: str, revision: str, local: Path) -> None:
        self.repo, self.revision, self.local = repo, revision, local

    def list_files(self) -> list[SourceFile]:
        raise NotImplementedError

    def read_head(self, name: str, nbytes: int) -> bytes:
        raise ManifestInvalid(f"{name}: its header was not proven")  # never: every one was

    def stream(self, name: str, start: int = 0) -> Iterator[bytes]:
        yield (self.local / name).read_bytes()[start:]


def listed(repo: str, commit: str, endpoint: str, token: Any) -> list[Any]:
    """The commit's files as the Hub's tree lists them (``RepoFile``: size, blob id, lfs, Xet)."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    return [f for f in api.list_repo_tree(repo, revision=commit, recursive=True, expand=True)
            if hasattr(f, "blob_id")]


def on_xet(files: list[Any]) -> bool:
    shards = [f for f in files if f.path.endswith(".safetensors")]
    return bool(shards) and all(getattr(f, "xet_hash", None) for f in shards)


def on_xet_at(repo: str, commit: str, endpoint: str) -> bool:
    """Whether every shard of ``repo@commit`` is in Xet (the Hub's tree says)."""
    from huggingface_hub import get_token

    try:
        return on_xet(listed(repo, commit, endpoint, get_token()))
    except Exception as exc:  # an endpoint without the tree API: it cannot say, so not proven
        log.info("event=tree_unavailable repo=%s err=%r", repo, exc)
        return False


def fetch_small(repo: str, commit: str, endpoint: str, files: list[Any], local: Path) -> dict[str, str]:
    """Every file but the shards, each checked against the tree (git blob id, or LFS sha256);
    returns each one's sha256. A file that does not match is deleted and refused."""
    from huggingface_hub import hf_hub_download

    out: dict[str, str] = {}
    for f in files:
        if f.path.endswith(".safetensors"):
            continue
        target = local / f.path
        if not (target.is_file() and _matches(target.read_bytes(), f)):
            path = Path(hf_hub_download(repo, f.path, revision=commit, endpoint=endpoint,
                                        local_dir=local))
            if not _matches(path.read_bytes(), f):
                path.unlink(missing_ok=True)
                raise ChecksumMismatch(
                    f"{f.path} from {endpoint} at {commit[:12]} is not the file the commit's tree "
                    f"names ({_want(f)}): nothing of it kept; retry, and report it if it persists")
        out[f.path] = hashlib.sha256(target.read_bytes()).hexdigest()
    return out


def _want(f: Any) -> str:
    return f"sha256 {f.lfs.sha256}" if f.lfs else f"git blob {f.blob_id}"


def _matches(data: bytes, f: Any) -> bool:
    if len(data) != f.size:
        return False
    if f.lfs:
        return hashlib.sha256(data).hexdigest() == f.lfs.sha256
    return git_blob_id(data) == f.blob_id


async def proven_headers(upstream: Any, pin: Pin, shards: list[SourceFile]) -> dict[str, bytes]:
    """Each shard's first 8 + N bytes, read through Xet and proven against its hash (the
    upstream's ``xet_source``); ``XetProofError`` for a shard whose bytes do not come proven."""

    async def read(name: str, end: int) -> bytes:
        data = bytes(await upstream.fetch_range(pin, name, 0, end))
        if not upstream.source.proven(pin, name):
            raise XetProofError(f"{name} of {pin.key}: the Hub serves it without an Xet hash, so "
                                "its header cannot be proven; pass --manifest or --build-manifest")
        return data

    async def one(f: SourceFile) -> tuple[str, bytes]:
        head = await read(f.name, min(f.size, FIRST_READ))
        n = header_length(head[:8], f.name)
        if 8 + n > len(head):
            head = await read(f.name, min(f.size, 8 + n))
        return f.name, head[: 8 + n]

    return dict(await asyncio.gather(*(one(f) for f in shards)))


def manifest_from_hub(repo: str, commit: str, settings: Any, local: Path) -> Manifest | None:
    """The manifest of ``repo@commit`` made from proven headers (``made="headers"``), the small
    files installed in ``local``; None where its shards are not in Xet."""
    from huggingface_hub import get_token

    token = get_token()
    files = listed(repo, commit, settings.endpoint, token)
    if not on_xet(files):
        return None
    sha = fetch_small(repo, commit, settings.endpoint, files, local)
    sources = [SourceFile(f.path, f.size, f.lfs.sha256 if f.lfs else sha.get(f.path))
               for f in sorted(files, key=lambda f: f.path)]
    by_name = {f.name: f for f in sources}
    if "config.json" not in by_name:
        raise ManifestInvalid(f"{repo}@{commit} has no config.json: not a model repo")
    small = _Proven(repo, commit, local)
    config_bytes = (local / "config.json").read_bytes()
    config = parse_config(config_bytes, repo)
    shards = shard_files(small, sources, by_name)
    pin = Pin(repo, commit, {f.name: FileInfo(f.name, f.size, f.sha256 or "", 0) for f in sources})
    headers = asyncio.run(_read_headers(settings, token, pin, shards))
    plan = make_plan(small, shards, headers)
    log.info("event=manifest_from_headers repo=%s revision=%s shards=%d", repo, commit, len(shards))
    return manifest_from_plan(repo, commit, config, config_bytes, sources, plan, made="headers",
                              sha256=sha)


async def _read_headers(settings: Any, token: Any, pin: Pin,
                        shards: list[SourceFile]) -> dict[str, bytes]:
    from cachecd.upstream.choose import open_upstream

    upstream = await asyncio.to_thread(open_upstream, settings, token)
    share_kept(upstream)
    try:
        return await proven_headers(upstream, pin, shards)
    finally:
        await upstream.close()


def share_kept(upstream: Any) -> None:
    """Setup's upstreams keep their proven chunks in ``KEPT`` (one Xet route's cache)."""
    if hasattr(upstream.source, "kept"):
        upstream.source.kept = KEPT
