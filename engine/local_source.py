"""An ExpertSource that reads expert bytes straight from a local checkpoint (tests and benches).

Invariants:
- The bytes it returns are exactly what the daemon serves: the expert's manifest ranges
  concatenated in order, and (with ``verify``) they match the expert's xxh3-128.
- ``manifest_from_dir`` builds the same manifest shape the hub builder does (ranges are maximal
  contiguous runs in (shard order, offset) order), from files on disk; it is not the production
  builder, which hashes through the hub and checks each shard's sha256 against it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import xxhash

from cachecd import errors
from cachecd.manifest.build import build_manifest
from cachecd.manifest.entries import ExpertEntry
from cachecd.manifest.manifest import Manifest
from cachecd.manifest.source import LocalSource as FolderSource

LOCAL_REVISION = "0" * 40


def manifest_from_dir(model_dir: Path, repo: str = "local/model") -> Manifest:
    """Build and validate a manifest of the checkpoint in ``model_dir`` (reads every byte once)."""
    return build_manifest(FolderSource(model_dir, repo, LOCAL_REVISION), progress=False)


class LocalSource:
    """Reads each expert's ranges with pread from the checkpoint files; one fd per shard."""

    def __init__(self, manifest: Manifest, model_dir: Path, *, verify: bool = True) -> None:
        self.manifest = manifest
        self.model_dir = model_dir
        self.verify = verify
        self.calls: list[tuple[int, list[int]]] = []
        self.prefetched: list[tuple[int, list[int]]] = []
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()  # read-ahead reads from other threads

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = self._fds[name] = os.open(self.model_dir / name, os.O_RDONLY)
            return fd

    def entry(self, layer: int, expert: int) -> ExpertEntry:
        return self.manifest.expert(layer, expert)

    def read_into(self, layer: int, ids: list[int], targets: Sequence[Sequence[memoryview]],
                  landed: Callable[[int, int], None] | None = None) -> int:
        with self._lock:
            self.calls.append((layer, list(ids)))
        written = 0
        for i, (e, target) in enumerate(zip(ids, targets, strict=True)):
            n = self._read(self.entry(layer, e), list(target))
            written += n
            if landed is not None:
                landed(i, n)
        return written

    def _read(self, entry: ExpertEntry, target: list[memoryview]) -> int:
        views = [v.cast("B") for v in target]
        if sum(v.nbytes for v in views) != entry.nbytes:
            raise errors.ExpertSizeMismatch(
                f"targets hold {sum(v.nbytes for v in views)} bytes; layer={entry.layer} "
                f"expert={entry.expert} has {entry.nbytes}"
            )
        written = 0
        for r in entry.ranges:
            part, views = _take(views, r.length)
            got = os.preadv(self._fd(r.file), part, r.start)
            if got != r.length:
                raise errors.ExpertSizeMismatch(f"{r.file}: short read at {r.start} ({got} bytes)")
            written += got
        if self.verify:
            h = xxhash.xxh3_128()
            for v in target:
                h.update(v)
            if h.digest() != entry.xxh3:
                raise errors.ChecksumMismatch(
                    f"layer={entry.layer} expert={entry.expert}: bytes on disk do not match the "
                    f"manifest"
                )
        return written

    def prefetch(self, layer: int, ids: list[int]) -> None:
        with self._lock:
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


def _take(views: list[memoryview], n: int) -> tuple[list[memoryview], list[memoryview]]:
    """The first ``n`` bytes of a list of buffers, and the rest."""
    head: list[memoryview] = []
    while n:
        v = views[0]
        if v.nbytes <= n:
            head.append(v)
            views = views[1:]
            n -= v.nbytes
        else:
            head.append(v[:n])
            views = [v[n:], *views[1:]]
            n = 0
    return head, views
