"""Streaming one range request straight into the blob writers of the experts it carries.

Used by ``fetch.Upstream.fetch_experts`` with a spool, for requests whose experts each have one
byte range (the usual layout: an expert's tensors sit side by side in one shard).

Invariants:
- Each expert's xxh3-128 is computed over its bytes in order, from the very chunks that are
  written; a retry (``restart``) first waits for every write of the abandoned attempt, then
  starts the hashes over, so the file ends up holding exactly the hashed bytes of one attempt.
- Writes run on worker threads (``pool``), a few MiB at a time (``pwritev`` of the chunks
  themselves: no copy in Python). ``settle`` waits for all of them and reports whether every
  one succeeded.
- A writer is opened (``spool.begin``) only when bytes for it arrive; whoever ends the stream
  decides, after ``settle``, whether the spool keeps it (verified) or discards it.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import Any, Protocol

import xxhash

log = logging.getLogger(__name__)

WRITE_STEP = 2 << 20


class VectorWriter(Protocol):
    def writev(self, offset: int, views: list[memoryview]) -> None: ...


class _Part:
    """One expert inside the request: where it lies, its hash so far, its unwritten chunks."""

    __slots__ = ("end", "entry", "failed", "hasher", "index", "queued", "queued_at", "queued_len",
                 "start", "writer")

    def __init__(self, index: int, entry: Any, start: int, end: int) -> None:
        self.index, self.entry, self.start, self.end = index, entry, start, end
        self.hasher = xxhash.xxh3_128()
        self.writer: VectorWriter | None = None
        self.queued: list[memoryview] = []
        self.queued_at = self.queued_len = 0
        self.failed = False


class Stream:
    """The ``hub_client.Consumer`` of one request; ``pieces`` are (state index, entry, absolute
    start, absolute end) of single-range experts, ``origin`` the request's first byte."""

    def __init__(
        self, origin: int, pieces: list[tuple[int, Any, int, int]], spool: Any, pool: Executor
    ) -> None:
        self.parts = [_Part(i, e, s - origin, t - origin) for i, e, s, t in pieces]
        self._spool, self._pool = spool, pool
        self._pending: list[asyncio.Future[None]] = []

    async def restart(self) -> None:
        await self.settle()
        for part in self.parts:
            part.hasher.reset()
            part.queued, part.queued_at, part.queued_len = [], 0, 0

    def feed(self, chunk: bytes, pos: int) -> None:
        view, end = memoryview(chunk), pos + len(chunk)
        for part in self.parts:
            a, b = max(pos, part.start), min(end, part.end)
            if a >= b:
                continue
            piece = view[a - pos : b - pos]
            part.hasher.update(piece)
            if not part.queued:
                part.queued_at = a - part.start
            part.queued.append(piece)
            part.queued_len += b - a
            if part.queued_len >= WRITE_STEP or b == part.end:
                self._write(part)

    def _write(self, part: _Part) -> None:
        views, offset = part.queued, part.queued_at
        part.queued, part.queued_len = [], 0
        if part.failed:
            return
        if part.writer is None:
            try:
                part.writer = self._spool.begin(part.entry)
            except Exception as exc:  # the expert is fetched again the buffered way
                log.warning("event=spill_begin_failed err=%s", exc)
                part.failed = True
                return
        loop = asyncio.get_running_loop()
        self._pending.append(loop.run_in_executor(self._pool, part.writer.writev, offset, views))

    async def settle(self) -> bool:
        """Wait for every write queued so far; False if any failed."""
        pending, self._pending = self._pending, []
        if not pending:
            return True
        results = await asyncio.shield(asyncio.gather(*pending, return_exceptions=True))
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            log.warning("event=spill_failed n=%d err=%s", len(failed), failed[0])
            for part in self.parts:  # which write failed is not known: trust none
                part.failed = True
        return not failed

    def digest(self, part: _Part) -> bytes:
        return part.hasher.digest()
