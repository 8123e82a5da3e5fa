"""Eviction policies: which committed blobs to drop when a reservation needs room.

A policy only ranks; the store owns the entries and the budget. ``victims`` must not change the
policy's view of which entries exist: the store calls ``on_remove`` for each entry it really
drops (by eviction, quarantine or a missing file). Entries in ``exclude`` (pins) are never
returned. Policies are not thread-safe; the store calls them under its own lock. The store
calls ``on_insert`` when fetched bytes commit and ``on_access`` for each use, including the use
that caused the fetch.

- ``lru``: least recently used first. The baseline.
- ``lfuda``: LFU with dynamic aging. Priority = L + hits, where L is the priority of the last
  evicted entry; ties go to the least recently used.
- ``wlfu`` (the default): a windowed LFU. New entries enter a small LRU window; the rest of the
  cache is ranked by use counts that outlive eviction (a returning expert keeps its history)
  and are halved every ``halve_every`` x (cache size) uses, so a hot set that drifted away
  fades. When the window is full its oldest entry must out-count the least used entry of the
  rest to stay. The window's share adapts from ghosts (recently evicted digests): a miss on one
  the window dropped grows it (recency is paying), a miss on one the frequency part dropped
  shrinks it. MoE routing is skewed and cyclic (every layer each token), which LRU handles
  badly once a token's experts outnumber the cache; bursts (a prefill reusing its experts)
  want recency. bench/policy_eval.py measures all of them against Belady's optimum.
  Every expert of a model has the same size, so the window is sized in entries.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Container, Generator
from typing import Protocol


class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, digest: str, size: int, count: int = 0) -> None: ...

    def restore(self, rows: list[tuple[str, int, int]]) -> None:
        """The entries found at open, least recently used first, as (digest, size, count):
        the same state as ``on_insert`` of each in that order."""
        ...

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

    def restore(self, rows: list[tuple[str, int, int]]) -> None:
        for digest, size, count in rows:
            self.on_insert(digest, size, count)

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

    def restore(self, rows: list[tuple[str, int, int]]) -> None:
        for digest, size, count in rows:
            self.on_insert(digest, size, count)

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


class WindowLFU:
    """The default: an adaptive LRU window in front of a frequency-ranked main part."""

    name = "wlfu"

    def __init__(
        self, *, window: float = 0.0, ghosts: float = 0.25, halve_every: float = 32.0
    ) -> None:
        self._share = window  # the window's target share of the cache, adapted by ghost hits
        self._ghost_share = ghosts
        self._halve_every = halve_every
        self._counts: dict[str, int] = {}  # uses, halved now and then; outlives eviction
        self._window: OrderedDict[str, int] = OrderedDict()  # digest -> size, oldest first
        self._main: dict[str, tuple[int, int, int]] = {}  # digest -> (count, tick, size)
        self._heap: list[tuple[int, int, str]] = []  # (count, tick, digest); stale rows skipped
        self._ghost_window: OrderedDict[str, None] = OrderedDict()
        self._ghost_main: OrderedDict[str, None] = OrderedDict()
        self._tick = itertools.count()
        self._peak = 1  # most entries held at once: the cache's size in entries
        self._uses = 0

    def __len__(self) -> int:
        return len(self._window) + len(self._main)

    def _window_cap(self) -> int:
        # Both parts keep at least one entry: evictions from each feed its ghost list, which is
        # the only way the share can move back from either end.
        return min(max(int(self._share * self._peak), 1), max(self._peak - 1, 1))

    def on_insert(self, digest: str, size: int, count: int = 0) -> None:
        self._adapt(digest)
        if count:
            self._counts[digest] = self._counts.get(digest, 0) + count
        self._main.pop(digest, None)
        self._window[digest] = size
        self._window.move_to_end(digest)
        self._peak = max(self._peak, len(self))
        while len(self._window) > self._window_cap():
            self._spill()

    def restore(self, rows: list[tuple[str, int, int]]) -> None:
        # At K3 scale (~82k entries at open) one on_insert each costs a quarter of a second.
        # Into an empty policy the result is known: no ghost moves the share, the window's cap
        # only grows as the inserts raise the peak, so it ends holding the last cap entries
        # and the main part the others, spilled in order.
        fresh = not (len(self) or self._counts or self._ghost_window or self._ghost_main)
        if not fresh or len({d for d, _, _ in rows}) != len(rows):
            for digest, size, count in rows:
                self.on_insert(digest, size, count)
            return
        if not rows:
            return
        self._counts = {d: c for d, _, c in rows if c}
        self._peak = max(self._peak, len(rows))
        split = len(rows) - self._window_cap()
        for digest, size, _ in rows[:split]:
            self._main[digest] = (self._counts.get(digest, 0), next(self._tick), size)
        self._rebuild()
        self._window = OrderedDict((d, size) for d, size, _ in rows[split:])

    def on_access(self, digest: str) -> None:
        if digest in self._window:
            self._window.move_to_end(digest)
            self._use(digest)
        elif digest in self._main:
            self._use(digest)
            self._to_main(digest, self._main[digest][2])

    def on_remove(self, digest: str) -> None:
        if self._window.pop(digest, None) is not None:
            ghosts = self._ghost_window
        elif self._main.pop(digest, None) is not None:
            ghosts = self._ghost_main
            if self._window and len(self._window) >= self._window_cap():
                self._spill()  # the window's oldest won its place (see victims)
        else:
            return
        ghosts[digest] = None
        while len(ghosts) > max(1, int(self._ghost_share * self._peak)):
            ghosts.popitem(last=False)

    def victims(self, n_bytes: int, exclude: Container[str]) -> list[str]:
        out: list[str] = []
        got = 0
        window = ((d, s) for d, s in self._window.items() if d not in exclude)
        main = self._main_order(exclude)
        cand, low = next(window, None), next(main, None)
        # While the window is at its cap the next insert pushes its oldest out: that entry
        # stays only if it out-counts the least used entry of the main part.
        over = len(self._window) - self._window_cap()
        while got < n_bytes and (cand is not None or low is not None):
            if cand is not None and (
                low is None or (over >= 0 and self._counts.get(cand[0], 0) <= low[1])
            ):
                out.append(cand[0])
                got += cand[1]
                over -= 1
                cand = next(window, None)
            else:
                assert low is not None
                out.append(low[0])
                got += low[2]
                low = next(main, None)
        main.close()  # puts the rows it popped back
        return out

    def _main_order(self, exclude: Container[str]) -> Generator[tuple[str, int, int], None, None]:
        popped: list[tuple[int, int, str]] = []
        try:
            while self._heap:
                row = heapq.heappop(self._heap)
                count, tick, digest = row
                cur = self._main.get(digest)
                if cur is None or cur[1] != tick:
                    continue  # stale
                popped.append(row)
                if digest not in exclude:
                    yield digest, count, cur[2]
        finally:
            for row in popped:
                heapq.heappush(self._heap, row)

    def _adapt(self, digest: str) -> None:
        # ARC's rule: move the window's share by one entry (more when the other ghost list is
        # longer) towards the side whose eviction just proved wrong.
        gw, gm = self._ghost_window, self._ghost_main
        if digest in gw:
            del gw[digest]
            step = max(1.0, len(gm) / max(1, len(gw))) / self._peak
            self._share = min(1.0, self._share + step)
        elif digest in gm:
            del gm[digest]
            step = max(1.0, len(gw) / max(1, len(gm))) / self._peak
            self._share = max(0.0, self._share - step)

    def _spill(self) -> None:
        digest, size = self._window.popitem(last=False)
        self._to_main(digest, size)

    def _to_main(self, digest: str, size: int) -> None:
        tick = next(self._tick)
        count = self._counts.get(digest, 0)
        self._main[digest] = (count, tick, size)
        heapq.heappush(self._heap, (count, tick, digest))
        if len(self._heap) > 2 * len(self._main) + 64:
            self._rebuild()

    def _use(self, digest: str) -> None:
        self._counts[digest] = self._counts.get(digest, 0) + 1
        self._uses += 1
        if self._uses >= self._halve_every * self._peak:
            self._halve()

    def _halve(self) -> None:
        # Amortized O(1): runs once per halve_every x peak uses, over at most that many digests
        # plus the entries. Digests whose count reaches 0 are forgotten.
        self._uses = 0
        self._counts = {d: c >> 1 for d, c in self._counts.items() if c > 1}
        self._main = {d: (self._counts.get(d, 0), t, s) for d, (_c, t, s) in self._main.items()}
        self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(c, t, d) for d, (c, t, _s) in self._main.items()]
        heapq.heapify(self._heap)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRU,
    "lfuda": LFUDA,
    "wlfu": WindowLFU,
    "default": WindowLFU,
}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        from cachecd import errors

        raise errors.InvalidRequest(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
