"""Proven chunks kept in memory, by file and offset, so no chunk is read twice while it is kept.

A proof's window is a range widened to chunk boundaries and on to the right (``proof``); reads of
neighbouring ranges (a shard's header and the resident tensors after it, a small model's experts
side by side, the next layer's experts in the same shard) ask for windows that share chunks. Only
chunks of a window that proved against its file's Xet hash are kept; a later window takes the
ones it starts or ends with from here and reads only the chunks between, and its proof is
computed over all of them again, so a kept chunk is never trusted on its own.

Invariants: at most ``limit`` bytes kept, the least recently used dropped first; a chunk is kept
at the offset of the file it proved at, under that file's Xet hash.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

from cachecd import constants
from cachecd.upstream.xet_read import Chunk

LIMIT = constants.XET_KEEP_BYTES


class ChunkCache:
    def __init__(self, limit: int = LIMIT) -> None:
        self.limit, self.nbytes = limit, 0
        self._starts: dict[str, list[int]] = {}  # file hash -> sorted chunk starts
        self._at: dict[tuple[str, int], Chunk] = {}
        self._ends: dict[tuple[str, int], int] = {}  # (hash, end) -> start
        self._lru: OrderedDict[tuple[str, int], None] = OrderedDict()

    def add(self, file_hash: str, origin: int, chunks: list[Chunk]) -> None:
        """Keep the proven ``chunks``, laid end to end from byte ``origin`` of the file."""
        pos = origin
        for chunk in chunks:
            key = (file_hash, pos)
            if key not in self._at:
                bisect.insort(self._starts.setdefault(file_hash, []), pos)
                self._at[key] = chunk
                self._ends[(file_hash, pos + len(chunk.data))] = pos
                self.nbytes += len(chunk.data)
            self._lru[key] = None
            self._lru.move_to_end(key)
            pos += len(chunk.data)
        while self.nbytes > self.limit and self._lru:
            self._drop(*self._lru.popitem(last=False)[0])

    def covering(self, file_hash: str, start: int, end: int) -> tuple[list[Chunk], int] | None:
        """Kept chunks holding bytes [start, end) back to back, and the first one's offset."""
        starts = self._starts.get(file_hash) or []
        i = bisect.bisect_right(starts, start) - 1
        if i < 0:
            return None
        origin = starts[i]
        run, pos = self.run_from(file_hash, origin, end)
        return (run, origin) if run and pos >= end else None

    def run_from(self, file_hash: str, pos: int, limit: int) -> tuple[list[Chunk], int]:
        """Kept chunks back to back from byte ``pos`` while they end by ``limit``; where the run
        stops (``pos`` when none)."""
        run: list[Chunk] = []
        while pos < limit and (chunk := self._take((file_hash, pos))) is not None:
            if pos + len(chunk.data) > limit and run:
                break
            run.append(chunk)
            pos += len(chunk.data)
        return run, pos

    def run_to(self, file_hash: str, end: int, floor: int) -> tuple[list[Chunk], int]:
        """Kept chunks back to back ending at byte ``end``, none starting before ``floor``; where
        the run starts (``end`` when none)."""
        run: list[Chunk] = []
        while end > floor and (start := self._ends.get((file_hash, end))) is not None \
                and start >= floor:
            chunk = self._take((file_hash, start))
            if chunk is None:
                break
            run.append(chunk)
            end = start
        return run[::-1], end

    def _take(self, key: tuple[str, int]) -> Chunk | None:
        chunk = self._at.get(key)
        if chunk is not None:
            self._lru.move_to_end(key)
        return chunk

    def _drop(self, file_hash: str, pos: int) -> None:
        chunk = self._at.pop((file_hash, pos))
        self._ends.pop((file_hash, pos + len(chunk.data)), None)
        starts = self._starts[file_hash]
        del starts[bisect.bisect_left(starts, pos)]
        self.nbytes -= len(chunk.data)
