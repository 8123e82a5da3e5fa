"""The ledger: the in-memory view of what the cache holds. ``Ledger`` owns the entries, the
eviction policy, the pins and the budget (``budget.Budget``) under one lock, and hands out
victims; the store does the I/O (rows, files) around it. The invariants are the budget's
(``budget``), kept under this lock; the store alone reaches the ledger, and the daemon asks the
store (``Store.hold``, ``Store.entry``, ``Store.policy_touch``...).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from cachecd.store.budget import Budget, Reservation
from cachecd.store.index import Entry
from cachecd.store.policies import EvictionPolicy

# Restored lifetime counts are capped: the policy's aging restarts at 0 after a restart, and an
# expert that was hot last month must not outrank today's hot set for weeks.
RESTORED_HITS_CAP = 8


class Victims:
    """Entries taken out of the ledger whose rows and files are still being removed."""

    def __init__(self, where: dict[str, Entry]) -> None:
        self.where = where
        self.done = threading.Event()
        self.rows: Future[None] | None = None

    @property
    def nbytes(self) -> int:
        return sum(e.size for e in self.where.values())


class _Either:
    """``d in pins or d in held`` without building their union for every pick."""

    def __init__(self, a: set[str], b: Counter[str]) -> None:
        self.a, self.b = a, b

    def __contains__(self, digest: object) -> bool:
        return digest in self.a or digest in self.b


class Ledger:
    def __init__(
        self, budget: Budget, policy: EvictionPolicy, entries: dict[str, Entry],
        pins: set[str], counts: dict[str, tuple[int, float]],
    ) -> None:
        self.mu = threading.RLock()
        self.budget = budget
        self.policy = policy
        self.entries = entries
        self.pins = pins
        self.held: Counter[str] = Counter()  # digest -> requests under way that need it
        # digest -> the source keys its blob was verified as (store/sources.py); an entry's go
        # with it. Read without the lock on the hit path (a dict and a set look-up).
        self.sources: dict[str, set[str]] = {}
        self.unlinking: dict[str, threading.Event] = {}
        self.inserted: list[threading.Event] = []  # each set when a blob comes in (the scrub's)
        self.counters = dict.fromkeys(
            ("uses_cached", "uses_gone", "inserts", "evictions", "bytes_evicted", "quarantined",
             "verified_on_open", "bit_rot_on_open", "missing_on_open", "bit_rot_on_read",
             "rechecked_good"), 0
        )
        none = (0, 0.0)
        rows = [(counts.get(d, none), d, e.size) for d, e in entries.items()]
        rows.sort(key=lambda row: row[0][1])  # least recently used first
        policy.restore([(d, size, min(c[0], RESTORED_HITS_CAP)) for c, d, size in rows])
        budget.add_used(sum(e.size for e in entries.values()))

    # ---- eviction: each returns Victims already out of memory and out of ``used`` -------

    def reserve(self, nbytes: int) -> tuple[Reservation, Victims]:
        with self.mu:
            res, picked = self.budget.reserve(nbytes, self._pick, self._release)
            return res, self._detach(picked)

    def take(self, digests: list[str] | None = None, nbytes: int = 0) -> Victims:
        """The given digests (pinned ones skipped), else ``nbytes`` by policy, else the
        overflow above the budget."""
        with self.mu:
            if digests is not None:
                picked = [
                    (d, self.entries[d].size) for d in dict.fromkeys(digests)
                    if d in self.entries and d not in self.pins and d not in self.held
                ]
            else:
                picked = self._pick(nbytes if nbytes > 0 else max(self.budget.overflow(), 0))
            self.budget.remove_used(sum(size for _, size in picked))
            return self._detach(picked)

    def settle(self, victims: Victims) -> int:
        """The victims' rows and files are gone: a commit of the same bytes may go ahead."""
        with self.mu:
            for d in victims.where:
                if self.unlinking.get(d) is victims.done:
                    del self.unlinking[d]
            self.counters["evictions"] += len(victims.where)
            self.counters["bytes_evicted"] += victims.nbytes
        victims.done.set()
        return victims.nbytes

    def _pick(self, need: int) -> list[tuple[str, int]]:
        if need <= 0:
            return []
        spared = _Either(self.pins, self.held) if self.held else self.pins
        return [(d, self.entries[d].size) for d in self.policy.victims(need, spared)]

    def hold(self, digests: Iterable[str]) -> None:
        """Spare these from eviction until ``release_hold`` (counted: holds nest)."""
        with self.mu:
            self.held.update(digests)

    def release_hold(self, digests: Iterable[str]) -> None:
        with self.mu:
            self.held.subtract(digests)
            for d in [d for d, n in self.held.items() if n <= 0]:
                del self.held[d]

    def _detach(self, picked: list[tuple[str, int]]) -> Victims:
        victims = Victims({d: self.entries.pop(d) for d, _ in picked})
        for d in victims.where:
            self.sources.pop(d, None)
            self.policy.on_remove(d)
            self.unlinking[d] = victims.done
        return victims

    def _release(self, res: Reservation) -> None:
        with self.mu:
            self.budget.release(res)

    # ---- entries ---------------------------------------------------------------------

    def insert(self, digest: str, entry: Entry, res: Reservation, source: str) -> bool:
        """Turn the reservation into the entry, verified as ``source``; False if a racing
        commit got there first."""
        with self.mu:
            if digest in self.entries:
                self.budget.release(res)
                self.add_source(digest, source)
                return False
            self.budget.commit(res, entry.size)
            self.entries[digest] = entry
            self.sources[digest] = {source}
            self.policy.on_insert(digest, entry.size)
            self.counters["inserts"] += 1
            for event in self.inserted:
                event.set()
            return True

    def add_source(self, digest: str, source: str) -> bool:
        """Record one more source of a cached blob; False if the blob is gone meanwhile."""
        with self.mu:
            if digest not in self.entries:
                return False
            known = self.sources.setdefault(digest, set())
            if source not in known:
                # Copy, then swap: the hit path reads the set without the lock.
                self.sources[digest] = known | {source}
            return True

    def forget(self, digest: str, entry: Entry | None = None) -> Entry | None:
        """Drop one entry (if it is still ``entry`` when given); returns what was dropped."""
        with self.mu:
            current = self.entries.get(digest)
            if current is None or (entry is not None and current is not entry):
                return None
            del self.entries[digest]
            self.sources.pop(digest, None)
            self.policy.on_remove(digest)
            self.budget.remove_used(current.size)
            return current

    def touch(self, digest: str) -> None:
        with self.mu:
            if digest in self.entries:
                self.policy.on_access(digest)
                self.counters["uses_cached"] += 1
            else:
                self.counters["uses_gone"] += 1

    def snapshot(self) -> dict[str, Any]:
        with self.mu:
            return {
                "entries": len(self.entries),
                "bytes": self.budget.used,
                "budget": self.budget.limit,
                "reserved": self.budget.reserved,
                "quarantine_bytes": self.budget.set_aside,
                "pinned": len(self.pins),
                "pinned_bytes": sum(self.entries[d].size for d in self.pins if d in self.entries),
                "policy": self.policy.name,
                **self.counters,
            }
