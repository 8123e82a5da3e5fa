"""A model not installed, planned from the Hub: its config.json and its shards' safetensors
headers, read by Range requests, with no manifest and no daemon.

Invariants:
- Only the small files (config.json, the shard index) and each shard's header (its first
  8 bytes, then its first 8 + N) are read; no tensor's bytes. ``fetched`` counts every
  body byte read, so the plan can say how little it read against the shards' size.
- The manifest made here has the experts' true shapes, dtypes, sizes and layout (the headers'),
  so every figure of a plan (bytes per expert and per token, the pool's slots, the probes'
  shapes) is the one a built manifest gives; its hashes are placeholders (nothing was hashed),
  so it is never saved, registered or used to verify a byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cachecd.manifest.build_plan import (
    Plan,
    SourceFile,
    make_plan,
    parse_config,
    read_small,
    shard_files,
)
from cachecd.manifest.from_headers import manifest_from_plan
from cachecd.manifest.manifest import Manifest
from cachecd.manifest.safetensors_header import header_length


@dataclass
class HubModel:
    manifest: Manifest
    config: dict[str, Any]
    fetched: int  # body bytes read from the endpoint
    shard_bytes: int  # the shards' size: what a full pass would read


class _Counted:
    """A ``build_plan.Source`` that counts the body bytes it reads."""

    def __init__(self, source: Any) -> None:
        self.source, self.repo, self.revision = source, source.repo, source.revision
        self.fetched = 0

    def list_files(self) -> list[SourceFile]:
        return list(self.source.list_files())

    def read_head(self, name: str, nbytes: int) -> bytes:
        data = bytes(self.source.read_head(name, nbytes))
        self.fetched += len(data)
        return data

    def stream(self, name: str, start: int = 0) -> Iterator[bytes]:
        for chunk in self.source.stream(name, start):
            self.fetched += len(chunk)
            yield chunk


def from_hub(repo: str, revision: str, *, endpoint: str | None = None,
             token: str | None = None) -> HubModel:
    """The plan's view of ``repo@revision`` on ``endpoint`` (default: the configured one)."""
    from cachecd import errors
    from cachecd.manifest.source import HubSource

    source = _Counted(HubSource(repo, revision, endpoint=endpoint, token=token))
    files = sorted(source.list_files(), key=lambda f: f.name)
    by_name = {f.name: f for f in files}
    if "config.json" not in by_name:
        raise errors.NotFound(f"{repo}@{revision} has no config.json: not a model repo")
    config_bytes = read_small(source, by_name["config.json"])
    config = parse_config(config_bytes, repo)
    shards = shard_files(source, files, by_name)
    plan = make_plan(source, shards, {f.name: _header(source, f) for f in shards})
    if not plan.expert_tensors:
        raise errors.InvalidRequest(f"{repo}@{source.revision}: no routed expert tensors in its "
                                    "shards' headers; cachecd streams MoE models only")
    manifest = _manifest(source, config, config_bytes, files, plan)
    return HubModel(manifest, config, source.fetched, sum(s.file.size for s in plan.shards))


def config_of(repo: str, revision: str, sha256: str, *, endpoint: str,
              token: str | None = None) -> dict[str, Any]:
    """The config.json a manifest pins (``sha256``), from the Hub by one GET (no retries: the
    plan goes on without it); ChecksumMismatch where the endpoint serves other bytes."""
    from huggingface_hub import get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    from cachecd import errors
    from cachecd.manifest import bounded_http
    from cachecd.manifest.source import hub_errors, request_headers

    url = hf_hub_url(repo, "config.json", revision=revision, endpoint=endpoint)
    headers = request_headers(url, endpoint, build_hf_headers(token=token), {})
    plain = {k: v for k, v in headers.items() if k.lower() != "authorization"}

    def get() -> bytes:
        answer = bounded_http.get(get_session(), url, headers, cap=bounded_http.SMALL_FILE_BYTES,
                                  what=f"{repo}@{revision}/config.json", endpoint=endpoint,
                                  timeout=10, follow=True, plain=plain)
        bounded_http.as_response(answer).raise_for_status()
        return answer.body

    data = hub_errors(f"{repo}@{revision}/config.json", get)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise errors.ChecksumMismatch(f"{repo}@{revision}/config.json from {endpoint} is not "
                                      "the one the manifest pins")
    return parse_config(data, repo)


def _header(source: _Counted, f: SourceFile) -> bytes:
    """A shard's first 8 + N bytes, exactly: its header's length, then the header (a build's
    first read of 1 MiB would read a small shard whole)."""
    n = header_length(source.read_head(f.name, min(f.size, 8)), f.name)
    return source.read_head(f.name, min(f.size, 8 + n))


def _manifest(source: _Counted, config: dict[str, Any], config_bytes: bytes,
              files: list[SourceFile], plan: Plan) -> Manifest:
    return manifest_from_plan(source.repo, source.revision, config, config_bytes, files, plan)
