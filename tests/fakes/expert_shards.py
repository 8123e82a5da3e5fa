"""Test data for the upstream: shards of random bytes whose byte ranges are experts, described by
the real ``cachecd.manifest`` ExpertEntry/ByteRange/FileInfo classes, and the part of a Manifest
the upstream reads. Digests are computed from the bytes written, so they are right by
construction; a test breaks them on purpose through FakeHub's knobs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_REPO = "org/tiny"
DEFAULT_REVISION = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeManifest:
    """The part of ``cachecd.manifest.Manifest`` the upstream reads (repo, revision, files)."""

    repo: str
    revision: str
    files: dict[str, Any]
    entries: dict[tuple[int, int], Any]

    @property
    def key(self) -> str:
        return f"{self.repo}@{self.revision}"

    def expert(self, layer: int, expert: int) -> Any:
        return self.entries[(layer, expert)]


def write_expert_shards(
    folder: str | Path,
    *,
    layers: int = 2,
    experts: int = 6,
    expert_bytes: int = 48 * 1024,
    resident_gap: int = 4096,
    seed: int = 7,
    repo: str = DEFAULT_REPO,
    revision: str = DEFAULT_REVISION,
) -> FakeManifest:
    """Two shards of random bytes; experts are packed ranges, one of them split across shards.

    Between layers sits a ``resident_gap`` of bytes that belong to no expert. The split expert is
    the middle one of the last layer: its first half ends shard 1, its second half starts shard 2.
    """
    import numpy as np

    from cachecd.manifest.entries import ByteRange, ExpertEntry, FileInfo
    from cachecd.upstream.verify import digest

    rng = np.random.default_rng(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    split_at = (layers - 1, experts // 2)
    shards: list[bytearray] = [bytearray(rng.integers(0, 256, 64, dtype=np.uint8).tobytes())]
    pieces: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for layer in range(layers):
        shards[-1] += rng.integers(0, 256, resident_gap, dtype=np.uint8).tobytes()
        for e in range(experts):
            size = expert_bytes + 512 * e
            blob = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            if (layer, e) == split_at:
                half = size // 2
                pieces[(layer, e)] = [(0, len(shards[0]), half)]
                shards[0] += blob[:half]
                shards.append(bytearray())
                pieces[(layer, e)].append((1, 0, size - half))
                shards[1] += blob[half:]
                continue
            pieces[(layer, e)] = [(len(shards) - 1, len(shards[-1]), size)]
            shards[-1] += blob
    shards[-1] += b"tail" * 100
    files: dict[str, Any] = {}
    for name, data in zip(names, shards, strict=True):
        (folder / name).write_bytes(data)
        files[name] = FileInfo(name, len(data), hashlib.sha256(data).hexdigest(), 0)
    entries: dict[tuple[int, int], Any] = {}
    for key, parts in pieces.items():
        ranges = tuple(ByteRange(names[s], off, off + n) for s, off, n in parts)
        blob = b"".join(bytes(shards[s][off : off + n]) for s, off, n in parts)
        entries[key] = ExpertEntry(key[0], key[1], len(blob), digest(blob), ranges, (), ())
    return FakeManifest(repo, revision, files, entries)


def expert_bytes_of(folder: str | Path, entry: Any) -> bytes:
    """The expert's bytes read straight from the folder (the reference for a test)."""
    out = bytearray()
    for r in entry.ranges:
        with open(Path(folder) / r.file, "rb") as fh:
            fh.seek(r.start)
            out += fh.read(r.end - r.start)
    return bytes(out)
