"""One shard's pass: stream it once, hashing the file (sha256), every tensor and every expert.

A pass needs nothing from any other shard, so shards are hashed in parallel: an expert wholly
inside the shard gets its xxh3-128 here; an expert HF sharding split across shards keeps this
shard's piece of its bytes (``ShardResult.pieces``), hashed once every piece is in. A broken
transfer resumes at the byte it stopped at (a Range request), with the hashers as they were; the
result exists only once the whole file streamed and its sha256 equals the source's. The first
8 + N bytes streamed must be the header the plan was made from.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from cachecd import constants, errors
from cachecd.manifest.build_plan import Key, Plan, Shard, Source, check_sha

log = logging.getLogger(__name__)

MAX_RESUMES = 100  # per shard: a link that breaks this often will not carry a K3 shard anyway


class Stopped(Exception):
    """Another shard failed: this one stops at its next chunk (its work is not kept)."""


@dataclass
class ShardResult:
    file: str
    size: int
    sha256: str
    header: bytes
    tensors: list[bytes]  # xxh3-128 of each header tensor, in header (offset) order
    experts: dict[Key, bytes]  # experts wholly inside this shard
    pieces: dict[Key, tuple[int, int]]  # split experts: (offset, length) in ``piece_bytes``
    piece_bytes: bytes = b""  # this shard's bytes of its split experts, concatenated


@dataclass
class ShardPass:
    plan: Plan
    shard: Shard
    sha: Any = field(default_factory=hashlib.sha256)
    pos: int = 0
    i: int = 0  # the tensor the next byte belongs to
    cur: Any = field(default_factory=xxhash.xxh3_128)
    digests: list[bytes] = field(default_factory=list)
    hashers: dict[Key, Any] = field(default_factory=dict)
    left: dict[Key, int] = field(default_factory=dict)  # tensors of an expert still to come
    experts: dict[Key, bytes] = field(default_factory=dict)
    pieces: dict[Key, bytearray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for t in self.shard.tensors:
            key = self.plan.owner[t.name]
            if key is not None and key not in self.plan.split:
                self.left[key] = self.left.get(key, 0) + 1

    def feed(self, chunk: bytes) -> None:
        self.sha.update(chunk)
        tensors, pos = self.shard.tensors, self.pos
        mv, end = memoryview(chunk), pos + len(chunk)
        if pos < len(self.shard.header):
            self._check_header(mv, pos)
        while self.i < len(tensors) and tensors[self.i].start <= end:
            t = tensors[self.i]
            lo, hi = max(t.start, pos), min(t.end, end)
            key = self.plan.owner[t.name]
            if hi > lo:
                piece = mv[lo - pos : hi - pos]
                self.cur.update(piece)
                if key in self.plan.split:
                    self.pieces.setdefault(key, bytearray()).extend(piece)  # type: ignore[index]
                elif key is not None:
                    self.hashers.setdefault(key, xxhash.xxh3_128()).update(piece)
            if t.end > end:
                break
            self._finish_tensor(key)
            self.i, self.cur = self.i + 1, xxhash.xxh3_128()
        self.pos = end

    def _check_header(self, mv: memoryview, pos: int) -> None:
        head = self.shard.header
        n = min(len(head), pos + len(mv)) - pos
        if bytes(mv[:n]) != head[pos : pos + n]:
            raise errors.ChecksumMismatch(
                f"{self.shard.file.name}: the streamed header differs from the one read for the "
                "plan: the file changed during the build; build again"
            )

    def _finish_tensor(self, key: Key | None) -> None:
        self.digests.append(self.cur.digest())
        if key is None or key in self.plan.split:
            return
        self.left[key] -= 1
        if self.left[key] == 0:  # the expert's last byte: free its hasher early
            self.experts[key] = self.hashers.pop(key, xxhash.xxh3_128()).digest()

    def result(self) -> ShardResult:
        f = self.shard.file
        if self.pos != f.size or self.i != len(self.shard.tensors):
            raise errors.UpstreamError(f"{f.name}: stream ended at {self.pos} of {f.size} bytes")
        digest = self.sha.hexdigest()
        check_sha(f, digest)
        spans: dict[Key, tuple[int, int]] = {}
        blob = bytearray()
        for key in sorted(self.pieces):
            spans[key] = (len(blob), len(self.pieces[key]))
            blob += self.pieces[key]
        return ShardResult(f.name, f.size, digest, self.shard.header, self.digests,
                           self.experts, spans, bytes(blob))


def hash_shard(
    source: Source, plan: Plan, shard: Shard, progress: Any, stop: threading.Event
) -> ShardResult:
    """Stream one shard; a broken transfer resumes where it broke, up to MAX_RETRIES failures
    in a row without progress (and MAX_RESUMES in all). ``progress(n)`` is told of every chunk."""
    f = shard.file
    if f.sha256 is None and getattr(source, "requires_sha256", False):
        raise errors.UpstreamError(
            f"{f.name}: the endpoint gives no sha256 (X-Linked-Etag) to check it against"
        )
    p = ShardPass(plan, shard)
    failures = resumes = 0
    while True:
        start = p.pos
        try:
            for chunk in source.stream(f.name, start):
                if stop.is_set():
                    raise Stopped(f.name)
                p.feed(chunk)
                progress(len(chunk))
            return p.result()
        except errors.UpstreamError as exc:
            failures = 0 if p.pos > start else failures + 1
            resumes += 1
            if failures > constants.MAX_RETRIES or resumes > MAX_RESUMES or p.pos >= f.size:
                raise
            log.warning("shard_resume file=%s at=%d failures=%d error=%s", f.name, p.pos,
                        failures, exc)
            time.sleep(min(constants.BACKOFF_CAP_S, constants.BACKOFF_BASE_S * 2**failures))
