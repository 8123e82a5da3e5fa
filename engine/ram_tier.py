"""A RAM tier of hot experts: their bytes (blob layout) in memory, under a byte budget.

A hit is copied from here into the layer call's stack buffer (one memory copy, no disk read);
a demand read is copied back in after the kernel has its stack, if the policy admits it.

Invariants:
- ``bytes_used`` is the sum of the sizes of the experts held and never exceeds ``budget`` once a
  call returns. An expert bigger than the whole budget is not kept (a budget of 0 keeps nothing).
- Which expert leaves is the policy's: the daemon's own eviction policies (``cachecd.store.policies``),
  driven as the daemon's store drives them, so ``bench/ram_tier.py`` can rank them on routing
  traces with the same replay. Buffers of evicted experts are reused for the next admission of
  the same size, so a warm tier does not fault in new pages.
- Not thread-safe: the engine uses it from the thread that runs the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cachecd.store.policies import EvictionPolicy, make_policy

# Chosen by bench/ram_tier.py: with fewer slots than one token's experts, lru and lfuda keep
# nothing the next token needs (0 hits on every trace), wlfu keeps 0.40-0.80 of Belady.
DEFAULT_POLICY = "wlfu"


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    inserted_bytes: int = 0
    evicted_bytes: int = 0


class RamTier:
    def __init__(self, budget: int, policy: str = DEFAULT_POLICY) -> None:
        if budget < 0:
            raise ValueError(f"RAM tier budget must be >= 0, got {budget}")
        self.budget = budget
        self.bytes_used = 0
        self.counters = TierCounters()
        self.policy: EvictionPolicy = make_policy(policy)
        self._held: dict[str, np.ndarray] = {}
        self._spare: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return _name(*key) in self._held

    def lookup(self, layer: int, experts: Iterable[int]) -> dict[int, np.ndarray]:
        """The experts held (by id). A hit is a use; a miss becomes one if ``admit`` keeps it."""
        found: dict[int, np.ndarray] = {}
        asked = 0
        for e in experts:
            asked += 1
            blob = self._held.get(_name(layer, e))
            if blob is not None:
                self.policy.on_access(_name(layer, e))
                found[e] = blob
        self.counters.hits += len(found)
        self.counters.misses += asked - len(found)
        return found

    def peek(self, layer: int, experts: Iterable[int]) -> dict[int, np.ndarray]:
        """The experts held, without counting a use (read-ahead; the call counts it)."""
        found = {}
        for e in experts:
            blob = self._held.get(_name(layer, e))
            if blob is not None:
                found[e] = blob
        return found

    def admit(self, layer: int, expert: int, nbytes: int) -> np.ndarray | None:
        """A buffer to copy a demand-read expert into, after evicting what the policy says.

        As the daemon's store does on a miss: victims for the room, then insert, then the use.
        """
        key = _name(layer, expert)
        if key in self._held or nbytes > self.budget:
            return None
        room = self.bytes_used + nbytes - self.budget
        if room > 0:
            for victim in self.policy.victims(room, ()):
                self._drop(victim)
        if self.bytes_used + nbytes > self.budget:
            return None
        blob = self._buffer(nbytes)
        self._held[key] = blob
        self.policy.on_insert(key, nbytes)
        self.policy.on_access(key)
        self.bytes_used += nbytes
        self.counters.inserted_bytes += nbytes
        return blob

    def discard(self, layer: int, expert: int) -> None:
        """Forget an expert whose admission copy failed."""
        if _name(layer, expert) in self._held:
            self._drop(_name(layer, expert))

    def _buffer(self, nbytes: int) -> np.ndarray:
        for i, spare in enumerate(self._spare):
            if spare.size == nbytes:
                return self._spare.pop(i)
        return np.empty(nbytes, np.uint8)

    def _drop(self, key: str) -> None:
        blob = self._held.pop(key)
        self.policy.on_remove(key)
        self.bytes_used -= blob.size
        self.counters.evicted_bytes += blob.size
        if len(self._spare) < 2:
            self._spare.append(blob)

    def clear(self) -> None:
        for key in list(self._held):
            self.policy.on_remove(key)
        self._held.clear()
        self._spare.clear()
        self.bytes_used = 0


def _name(layer: int, expert: int) -> str:
    return f"{layer}:{expert}"
