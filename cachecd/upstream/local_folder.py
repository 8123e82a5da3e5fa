"""A source of expert bytes that reads a local folder of repos (``ROOT/ORG/NAME/FILE``, the
layout ``cachecd hub serve ROOT`` serves): for tests, and the proof that a new source kind is one
module plus one line in ``choose.KINDS``. Chosen by a ``file://ROOT`` endpoint.

A folder has no commits: its files are taken as the manifest's revision, and what ties them to
the manifest is the check on use (every file the manifest names present with its size, a shard
with its sha256; the layout against the shards' own headers) and, as for every source, each
expert's hash before it is served.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from cachecd import constants, errors
from cachecd.manifest.sha256 import file_sha256
from cachecd.upstream.source import Consumer, UseChecks, offline_error


class LocalFolder:
    """Ranges of ``root/REPO/FILE``, read on threads, ``max_parallel`` at a time."""

    def __init__(self, root: Path, *, offline: bool = False,
                 max_parallel: int = constants.MAX_PARALLEL_FETCHES) -> None:
        self.root = Path(root)
        self.where = f"file://{self.root}"
        self.offline = offline
        self.max_parallel = max_parallel
        self._slots = asyncio.Semaphore(max_parallel)
        self._counters: Counter[str] = Counter()
        self._in_flight = 0
        self._observe: Callable[[str, float], None] | None = None

    @classmethod
    def from_settings(cls, settings: Any) -> LocalFolder:
        root = Path(unquote(urlsplit(settings.endpoint).path))
        return cls(root, offline=settings.offline, max_parallel=settings.max_parallel)

    async def get_range(
        self, manifest: Any, file: str, start: int, end: int, consumer: Consumer | None = None
    ) -> bytearray:
        if self.offline:
            raise offline_error(f"{file} of {manifest.key}")
        if not 0 <= start < end:
            raise errors.InvalidRequest(f"empty or negative range {start}-{end} of {file}")
        path = self.root / manifest.repo / file
        async with self._slots:
            self._counters["requests_range"] += 1
            self._in_flight += 1
            started = time.monotonic()
            try:
                data = await asyncio.to_thread(_read, path, start, end)
            except OSError as exc:
                raise errors.UpstreamError(f"{path}: {exc}") from exc
            finally:
                self._in_flight -= 1
            if self._observe is not None:
                self._observe("range", time.monotonic() - started)
        if len(data) != end - start:
            self._counters["faults_truncated"] += 1
            raise errors.UpstreamError(f"{path}: {len(data)} bytes at {start}, not {end - start}")
        self._counters["bytes"] += len(data)
        if consumer is None:
            return data
        await consumer.restart()
        consumer.feed(bytes(data), 0)
        return bytearray()

    def use_checks(self, keep: Path, deadline_s: float) -> UseChecks:
        return UseChecks(self._check_files, self._check_layout)

    def _check_files(self, manifest: Any) -> None:
        for name, info in manifest.files.items():
            path = self.root / manifest.repo / name
            size = path.stat().st_size if path.is_file() else None
            if size != info.size:
                raise errors.ManifestMismatch(f"{manifest.source}: {path} is {size} bytes, the "
                                              f"manifest says {info.size}")
            if name in manifest.shards and file_sha256(path) != info.sha256:
                raise errors.ManifestMismatch(f"{manifest.source}: {path}'s sha256 is not the "
                                              "manifest's")

    def _check_layout(self, manifest: Any) -> None:
        from cachecd.manifest.layout_check import check_layout

        heads = {}
        for name in manifest.shards:
            with open(self.root / manifest.repo / name, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                f.seek(0)
                heads[name] = f.read(8 + n)
        check_layout(manifest, heads)

    def stats(self) -> dict[str, int]:
        return {**self._counters, "in_flight": self._in_flight}

    def count(self, name: str, n: int = 1) -> None:
        self._counters[name] += n

    def observe_requests(self, observe: Callable[[str, float], None]) -> None:
        self._observe = observe

    def offline_error(self, what: str) -> errors.Offline:
        return offline_error(what)

    async def close(self) -> None:
        return None


def _read(path: Path, start: int, end: int) -> bytearray:
    with open(path, "rb") as f:
        return bytearray(os.pread(f.fileno(), end - start, start))

