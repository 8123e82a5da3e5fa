"""Eviction policies: which committed blobs to drop when a reservation needs room.

A policy only ranks; the store owns the entries and the budget. ``victims`` must not change the
policy's view of which entries exist: the store calls ``on_remove`` for each entry it really
drops (by eviction, quarantine or a missing file). Entries in ``exclude`` (pins) are never
returned. Policies are not thread-safe; the store calls them under its own lock.

- ``lru``: least recently used first. The baseline.
- ``lfuda`` (the default): LFU with dynamic aging. Priority = L + hits, where L is the priority
  of the last evicted entry. Frequency keeps the hot experts of a skewed MoE routing
  distribution through a scan of one-off experts (which LRU lets flush the hot set); aging lets
  entries that were hot long ago fall out once the hot set drifts, which plain LFU never does.
  Every expert of a model has the same size, so the fetch cost per byte is flat and GDSF's
  size term would add nothing; ties go to the least recently used.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Container
from typing import Protocol


class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, digest: str, size: int, count: int = 0) -> None: ...

    def on_access(self, digest: str) -> None: ...

    def on_remove(self, digest: str) -> None: ...

    def victims(self, n_bytes: int, exclude: Container[str]) -> list[str]:
        """Entries to evict, in order, whose sizes sum to >= n_bytes; fewer if not possible."""
        ...

    def __len__(self) -> int: ...


class LRU:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def on_insert(self, digest: str, size: int, count: int = 0) -> None:
        self._order[digest] = size
        self._order.move_to_end(digest)

    def on_access(self, digest: str) -> None:
        if digest in self._order:
            self._order.move_to_end(digest)

    def on_remove(self, digest: str) -> None:
        self._order.pop(digest, None)

    def victims(self, n_bytes: int, exclude: Container[str]) -> list[str]:
        out: list[str] = []
        got = 0
        for digest, size in self._order.items():
            if got >= n_bytes:
                break
            if digest in exclude:
                continue
            out.append(digest)
            got += size
        return out


class LFUDA:
    name = "lfuda"

    def __init__(self) -> None:
        self._age = 0.0  # L: the priority of the last evicted entry
        self._entries: dict[str, tuple[float, int, int]] = {}  # digest -> (prio, tick, size)
        self._heap: list[tuple[float, int, str]] = []
        self._tick = itertools.count()
        self._hits: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _push(self, digest: str, size: int) -> None:
        prio = self._age + self._hits[digest]
        tick = next(self._tick)
        self._entries[digest] = (prio, tick, size)
        heapq.heappush(self._heap, (prio, tick, digest))
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._compact()

    def _compact(self) -> None:
        # Stale heap rows (from earlier accesses) are skipped lazily; rebuild when they pile up.
        self._heap = [(p, t, d) for d, (p, t, _s) in self._entries.items()]
        heapq.heapify(self._heap)

    def on_insert(self, digest: str, size: int, count: int = 0) -> None:
        self._hits[digest] = max(count, 1)
        self._push(digest, size)

    def on_access(self, digest: str) -> None:
        if digest in self._entries:
            self._hits[digest] += 1
            self._push(digest, self._entries[digest][2])

    def on_remove(self, digest: str) -> None:
        if self._entries.pop(digest, None) is not None:
            del self._hits[digest]

    def victims(self, n_bytes: int, exclude: Container[str]) -> list[str]:
        out: list[str] = []
        popped: list[tuple[float, int, str]] = []
        got = 0
        while got < n_bytes and self._heap:
            row = heapq.heappop(self._heap)
            _prio, tick, digest = row
            cur = self._entries.get(digest)
            if cur is None or cur[1] != tick:
                continue  # stale
            popped.append(row)
            if digest in exclude:
                continue
            out.append(digest)
            got += cur[2]
        for row in popped:
            heapq.heappush(self._heap, row)
        if got >= n_bytes and out:
            self._age = max(self._age, self._entries[out[-1]][0])
        return out


POLICIES: dict[str, type[LRU | LFUDA]] = {"lru": LRU, "lfuda": LFUDA, "default": LFUDA}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        from cachecd import errors

        raise errors.InvalidRequest(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
