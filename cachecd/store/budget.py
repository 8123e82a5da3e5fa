"""The byte budget: committed bytes plus reservations for writes in progress, plus the bytes
quarantine/ keeps (``set_aside``: a few bad blobs kept for a look, still on the disk). The ledger
(``ledger.Ledger``) holds it under its lock, with the entries, the policy and the pins.

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

from collections.abc import Callable
from types import TracebackType
from typing import Self

from cachecd import errors


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


