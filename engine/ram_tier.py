"""A RAM tier of decoded experts: an LRU keyed by (layer, expert) under a byte budget.

Invariants:
- ``bytes_used`` is the sum of ``nbytes`` of the entries held and never exceeds ``budget`` once a
  call returns. An expert bigger than the whole budget is not kept (a budget of 0 keeps nothing).
- Lookups move entries to the most-recently-used end; a batch is looked up in one call so the
  experts of one layer refresh together.
- Not thread-safe: the engine calls it from the thread that runs the model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from cachecd_engine.formats import DecodedExpert

Key = tuple[int, int]


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    inserted_bytes: int = 0
    evicted_bytes: int = 0


class RamTier:
    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"RAM tier budget must be >= 0, got {budget}")
        self.budget = budget
        self.bytes_used = 0
        self.counters = TierCounters()
        self._lru: OrderedDict[Key, DecodedExpert] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: Key) -> bool:
        return key in self._lru

    def get_many(
        self, layer: int, experts: Iterable[int]
    ) -> tuple[dict[int, DecodedExpert], list[int]]:
        """Return (found by expert id, missing ids in the order asked)."""
        found: dict[int, DecodedExpert] = {}
        missing: list[int] = []
        for e in experts:
            hit = self._lru.get((layer, e))
            if hit is None:
                missing.append(e)
                continue
            self._lru.move_to_end((layer, e))
            found[e] = hit
        self.counters.hits += len(found)
        self.counters.misses += len(missing)
        return found, missing

    def put(self, layer: int, expert: int, decoded: DecodedExpert) -> None:
        key = (layer, expert)
        if decoded.nbytes > self.budget:
            return
        old = self._lru.pop(key, None)
        if old is not None:
            self.bytes_used -= old.nbytes
        self._lru[key] = decoded
        self.bytes_used += decoded.nbytes
        self.counters.inserted_bytes += decoded.nbytes
        self._evict()

    def _evict(self) -> None:
        while self.bytes_used > self.budget:
            _, victim = self._lru.popitem(last=False)
            self.bytes_used -= victim.nbytes
            self.counters.evicted_bytes += victim.nbytes

    def clear(self) -> None:
        self._lru.clear()
        self.bytes_used = 0
