"""The byte budget, and the ledger: the in-memory view of what the cache holds.

``Budget`` counts committed bytes plus reservations for writes in progress, plus the bytes
quarantine/ keeps (``set_aside``: a few bad blobs kept for a look, still on the disk). ``Ledger`` owns the
entries, the eviction policy, the pins and the budget under one lock, and hands out victims;
the store does the I/O (rows, files) around it.

Invariants (``Budget``'s caller serializes every call; ``Ledger`` holds its lock around them):
- ``used + reserved + set_aside <= limit`` after every call, when ``limit > 0`` (0 = unlimited;
  free space still applies through ENOSPC at write time).
- A reservation is taken before any byte is written and ends exactly once: ``commit`` turns it
  into used bytes, ``release`` (a failed or abandoned write) returns it.
- A request bigger than the whole budget fails at once with ``TooLarge``; one that could fit
  only by evicting pinned or reserved bytes fails with ``ReservationsFull`` (retryable).
- Bytes chosen for eviction leave ``used`` in the same call that grants the reservation they make
  room for, so two reservations can never count the same freed bytes. On disk they are freed by
  the caller (unlink) before it starts writing, so disk usage stays within the budget.
- Pinned entries are never victims, nor are held ones (``hold``: the experts of a request under
  way, from its look-up until its fds are open, so that a fetch made for a request is not
  evicted by the others' before it is opened). A digest being evicted is registered in
  ``unlinking`` until its file is gone, so a new commit of the same bytes waits instead of
  losing its file.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Self

from cachecd import errors
from cachecd.store.index import Entry
from cachecd.store.policies import EvictionPolicy

# Restored lifetime counts are capped: the policy's aging restarts at 0 after a restart, and an
# expert that was hot last month must not outrank today's hot set for weeks.
RESTORED_HITS_CAP = 8


class Reservation:
    """Room for ``nbytes`` of one write. ``release()`` is idempotent; usable as ``async with``."""

    def __init__(self, budget: Budget, nbytes: int, release_hook: Callable[[], None]) -> None:
        self.nbytes = nbytes
        self._budget = budget
        self._hook = release_hook
        self.done = False

    def release(self) -> None:
        if not self.done:
            self._hook()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class Budget:
    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise errors.InvalidRequest(f"budget must be >= 0 bytes, got {limit}")
        self.limit = limit
        self.used = 0
        self.reserved = 0
        self.set_aside = 0  # quarantine/'s bytes: on the disk, not in the cache

    def overflow(self, extra: int = 0) -> int:
        """Bytes that must go for ``extra`` more to fit (<= 0: it fits)."""
        if self.limit == 0:
            return 0
        return self.used + self.reserved + self.set_aside + extra - self.limit

    def check_size(self, nbytes: int) -> None:
        if nbytes < 0:
            raise errors.InvalidRequest(f"cannot reserve a negative size ({nbytes})")
        if self.limit and nbytes > self.limit:
            raise errors.TooLarge(
                f"{nbytes} bytes can never fit in the cache budget of {self.limit} bytes; "
                "raise the budget"
            )

    def reserve(
        self, nbytes: int, pick_victims: Callable[[int], list[tuple[str, int]]],
        release_hook: Callable[[Reservation], None],
    ) -> tuple[Reservation, list[tuple[str, int]]]:
        """Grant ``nbytes``; returns the reservation and the (digest, size) victims to evict.

        ``pick_victims(need)`` proposes evictable entries (never pinned ones). The caller must
        remove the victims from its view in the same critical section and unlink them before
        writing.
        """
        self.check_size(nbytes)
        need = self.overflow(nbytes)
        victims: list[tuple[str, int]] = []
        if need > 0:
            victims = pick_victims(need)
            freed = sum(size for _, size in victims)
            if freed < need:
                raise errors.ReservationsFull(
                    f"cannot make room for {nbytes} bytes: budget {self.limit}, used "
                    f"{self.used}, reserved {self.reserved}, evictable {freed}; the rest is "
                    "pinned, being written or in use by requests. Retry shortly"
                )
            self.used -= freed
        self.reserved += nbytes
        res = Reservation(self, nbytes, lambda: release_hook(res))
        return res, victims

    def release(self, res: Reservation) -> None:
        if not res.done:
            res.done = True
            self.reserved -= res.nbytes

    def commit(self, res: Reservation, size: int) -> None:
        """The write finished: its reservation becomes ``size`` used bytes (size <= reserved)."""
        if res.done:
            raise errors.Internal("commit on a reservation that was already released")
        if size > res.nbytes:
            raise errors.InvalidRequest(
                f"blob of {size} bytes is larger than its reservation of {res.nbytes}"
            )
        res.done = True
        self.reserved -= res.nbytes
        self.used += size

    def add_used(self, size: int) -> None:
        """Bytes that exist without a reservation (loaded or adopted at open)."""
        self.used += size

    def remove_used(self, size: int) -> None:
        self.used -= size


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
        self.unlinking: dict[str, threading.Event] = {}
        self.counters = dict.fromkeys(
            ("hits", "misses", "inserts", "evictions", "bytes_evicted", "quarantined",
             "verified_on_open", "bit_rot_on_open", "missing_on_open"), 0
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
            self.policy.on_remove(d)
            self.unlinking[d] = victims.done
        return victims

    def _release(self, res: Reservation) -> None:
        with self.mu:
            self.budget.release(res)

    # ---- entries ---------------------------------------------------------------------

    def insert(self, digest: str, entry: Entry, res: Reservation) -> bool:
        """Turn the reservation into the entry; False if a racing commit got there first."""
        with self.mu:
            if digest in self.entries:
                self.budget.release(res)
                return False
            self.budget.commit(res, entry.size)
            self.entries[digest] = entry
            self.policy.on_insert(digest, entry.size)
            self.counters["inserts"] += 1
            return True

    def forget(self, digest: str, entry: Entry | None = None) -> Entry | None:
        """Drop one entry (if it is still ``entry`` when given); returns what was dropped."""
        with self.mu:
            current = self.entries.get(digest)
            if current is None or (entry is not None and current is not entry):
                return None
            del self.entries[digest]
            self.policy.on_remove(digest)
            self.budget.remove_used(current.size)
            return current

    def touch(self, digest: str) -> None:
        with self.mu:
            if digest in self.entries:
                self.policy.on_access(digest)
                self.counters["hits"] += 1
            else:
                self.counters["misses"] += 1

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
