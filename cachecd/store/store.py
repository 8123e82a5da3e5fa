"""The store: the one object the daemon uses for cached expert bytes.

It ties together the blob files (blobs.py), the LMDB index (index.py), the byte budget
(budget.py) and an eviction policy (policies.py), and runs recovery (recovery.py) at open. The
write path is commit.py's, the hashes on open and the quarantine integrity.py's, the model
records models.py's; their invariants are stated there.

Invariants:
- A blob on disk without a row is a stray: recovery adopts it (hash == name) or quarantines it
  at the next open. Eviction deletes the row first, then the file, so a crash between the two
  leaves a stray, never a dangling row.
- Usage <= budget + reservations, and usage + reservations <= budget once ``reserve`` returns:
  the bytes a reservation needs are evicted (unlinked) before ``reserve`` returns.
- An eviction never cuts off a read in progress: a reader holds an fd from ``open_blob`` and the
  kernel keeps an unlinked file's bytes until the last fd closes. No reader refcount is needed.
- In-memory state (entries, policy, budget, pins) lives in the ``Ledger`` (budget.py) under one
  lock; ``has`` and ``size_of`` read its dict without it (atomic in CPython). Blocking work
  (file I/O, fsync, hashing, LMDB commits) runs in threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cachecd import errors
from cachecd.store import sources
from cachecd.store.blobs import BlobDirs, BlobWriter, validate_digest
from cachecd.store.budget import Budget, Reservation
from cachecd.store.commit import BlobCommitter
from cachecd.store.index import INDEX_DIRNAME, Entry, Index
from cachecd.store.integrity import BlobIntegrity
from cachecd.store.ledger import Ledger, Victims
from cachecd.store.models import ModelRecords
from cachecd.store.policies import make_policy
from cachecd.store.recovery import RecoveryReport, mark_clean, recover
from cachecd.store.sources import ORIGIN_SOURCE

log = logging.getLogger(__name__)


class Store:
    def __init__(
        self, blobs: BlobDirs, index: Index, ledger: Ledger, report: RecoveryReport
    ) -> None:
        self.blobs = blobs
        self.index = index
        self.ledger = ledger
        self.recovery = report
        self._models = ModelRecords(index)
        self._closed = False
        self._integrity = BlobIntegrity(blobs, index, ledger)
        self._commits = BlobCommitter(blobs, index, ledger, self._integrity.verified, self)

    @property
    def budget(self) -> Budget:
        return self.ledger.budget

    @property
    def quarantine_seq(self) -> int:
        """Bumped by every quarantine (``integrity.py``)."""
        return self._integrity.quarantine_seq

    # ---- open / close ------------------------------------------------------------------

    @classmethod
    async def open(
        cls, dirs: list[Path], *, budget: int = 0, policy: str = "default",
        map_size: int | None = None, map_ceiling: int | None = None,
        full_recovery: bool | None = None,
    ) -> Store:
        """Lock the dirs, open the index, recover, evict down to the budget.

        ``full_recovery`` None: scan every blob file only after an unclean shutdown.
        """
        return await asyncio.to_thread(
            cls.open_sync, dirs, budget=budget, policy=policy, map_size=map_size,
            map_ceiling=map_ceiling, full_recovery=full_recovery,
        )

    @classmethod
    def open_sync(
        cls, dirs: list[Path], *, budget: int = 0, policy: str = "default",
        map_size: int | None = None, map_ceiling: int | None = None,
        full_recovery: bool | None = None,
    ) -> Store:
        with collector_paused():  # ~10^5 long-lived objects are made here at K3 scale
            the_budget, the_policy = Budget(budget), make_policy(policy)
            blobs = BlobDirs([Path(d) for d in dirs])
            index: Index | None = None
            try:
                index = Index(
                    Path(dirs[0]) / INDEX_DIRNAME, map_size=map_size, map_ceiling=map_ceiling
                )
                report, entries = recover(blobs, index, full=full_recovery)
                ledger = Ledger(
                    the_budget, the_policy, entries, index.load_pins(), index.load_digest_access()
                )
                ledger.sources = sources.load(index, entries)
                the_budget.set_aside = blobs.quarantine_bytes()  # evicted for below, if need be
                store = cls(blobs, index, ledger, report)
                report.bytes_evicted = store.evict_sync()
                report.evicted = ledger.counters["evictions"]
            except BaseException:
                if index is not None:
                    index.close()
                blobs.release()
                raise
        log.info(report.log_line())
        return store

    async def close(self) -> None:
        await asyncio.to_thread(self.close_sync)

    def close_sync(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.index.flush_access()
            mark_clean(self.index)
        except errors.CachecdError as exc:
            # A full disk loses the last access stats and forces a full scan at the next
            # open; neither loses an entry, so close still succeeds.
            log.warning("event=close_flush_failed err=%s", exc)
        finally:
            self.index.close()
            self.blobs.release()

    # ---- lookups (in memory) -----------------------------------------------------------

    def has(self, digest_hex: str) -> bool:
        return validate_digest(digest_hex) in self.ledger.entries

    def has_source(self, digest: str, source: str) -> bool:
        """Whether ``digest`` is cached AND its blob was verified as ``source`` (an expert's
        source key, ``manifest.provenance``): only then is it a hit for that expert. In memory,
        no lock (the ledger swaps a digest's set, never changes it in place)."""
        return source in self.ledger.sources.get(digest, ())

    def add_source(self, digest: str, source: str, origin: bytes = ORIGIN_SOURCE) -> bool:
        """Bytes read from ``source`` hashed to ``digest``, which is cached: record it (durably
        first), so the blob serves that source's experts too; no second copy. False if the blob
        is gone meanwhile. Blocking (an LMDB commit)."""
        if self.has_source(digest, source):
            return True
        sources.put(self.index, [(digest, source, origin)]).result()
        return self.ledger.add_source(digest, source)

    def provenance_pending(self) -> bool:
        """Rows from before schema 2 still wait to be attributed (``adopt_sources``)."""
        return self.index.get_meta(sources.PENDING) is not None

    def unattributed(self) -> list[str]:
        """Cached digests with no recorded source: they serve nothing until re-verified."""
        with self.ledger.mu:
            return [d for d in self.ledger.entries if not self.ledger.sources.get(d)]

    def adopt_sources(self, found: dict[str, str]) -> None:
        """The one-time attribution of rows from before schema 2 (``found``: digest -> source
        key), then the pending mark cleared, in one txn. Blocking."""
        rows = [(d, s, sources.ORIGIN_ADOPTED) for d, s in found.items()]
        put = sources.put_op(self.index, rows)

        def op(txn: Any) -> None:
            put(txn)
            txn.delete(sources.PENDING, db=self.index.meta)

        self.index.submit(op).result()
        for digest, source in found.items():
            self.ledger.add_source(digest, source)

    def size_of(self, digest_hex: str) -> int | None:
        entry = self.ledger.entries.get(validate_digest(digest_hex))
        return entry.size if entry else None

    def entry(self, digest: str) -> Entry | None:
        return self.ledger.entries.get(digest)

    def quarantined_since(self, seq: int, digests: list[str]) -> bool:
        """Whether any of ``digests`` was quarantined after ``quarantine_seq`` was ``seq``."""
        return self._integrity.quarantined_since(seq, digests)

    def digests(self) -> list[str]:
        with self.ledger.mu:
            return list(self.ledger.entries)

    def open_blob(self, digest_hex: str) -> tuple[int, int]:
        """(fd, size) of a committed blob; the caller closes the fd. ``BlobIntegrity.open_blob``."""
        return self._integrity.open_blob(digest_hex)

    def unverified(self, digest: str) -> bool:
        """True until this process hashed the blob's bytes; ``BlobIntegrity.unverified``."""
        return self._integrity.unverified(digest)

    def verify_open_blob(self, digest: str, fd: int) -> None:
        """Hash an opened blob and close ``fd``; ``BlobIntegrity.verify_open_blob``."""
        self._integrity.verify_open_blob(digest, fd)

    def recheck(self, digest_hex: str) -> str:
        """A reader found the blob's bytes wrong; ``BlobIntegrity.recheck``'s verdict."""
        return self._integrity.recheck(digest_hex)

    def scrub_verdict(self, digest: str, entry: Entry, got: str) -> bool:
        """The scrub's hash of ``entry``'s blob; ``BlobIntegrity.scrub_verdict``."""
        return self._integrity.scrub_verdict(digest, entry, got)

    # ---- writing -----------------------------------------------------------------------

    async def reserve(self, nbytes: int) -> Reservation:
        """Room for ``nbytes``; evicts (unlinks) victims before returning.

        Raises ``TooLarge`` (never fits) or ``ReservationsFull`` (retry later).
        """
        return await asyncio.to_thread(self.reserve_sync, nbytes)

    def reserve_sync(self, nbytes: int) -> Reservation:
        res, victims = self.ledger.reserve(nbytes)
        self._remove(victims)
        return res

    def begin_blob(self, digest_hex: str, nbytes: int) -> BlobWriter:
        """A temp file to fill with the blob's bytes while they arrive; hand it to ``commit``
        once they are all written and verified (or ``abort`` it)."""
        return self.blobs.begin(validate_digest(digest_hex), nbytes)

    async def commit(
        self,
        digest_hex: str,
        data: bytes | memoryview | None,
        reservation: Reservation,
        writer: BlobWriter | None = None,
        source: str = "",
        origin: bytes = ORIGIN_SOURCE,
    ) -> None:
        """Write, fsync, rename, index. The reservation ends here (used or released).

        ``source`` is the source key the bytes were verified as (``sources.py``), recorded with
        the row; a blob already cached only gains that source (no second copy).

        ``writer`` (from ``begin_blob``) already holds exactly the verified bytes (``data``, or
        None when they were streamed and never held in memory): it is fsynced and renamed
        instead of writing them again; it is finished or aborted here either way.
        Runs to completion in a thread even if the awaiting task is cancelled, so the blob, its
        row and the budget always agree.
        """
        try:
            digest = validate_digest(digest_hex)
        except errors.InvalidRequest:
            reservation.release()
            if writer is not None:
                writer.abort()
            raise
        await asyncio.shield(
            asyncio.to_thread(self.commit_sync, digest, data, reservation, writer, source, origin)
        )

    def commit_sync(
        self,
        digest_hex: str,
        data: bytes | memoryview | None,
        res: Reservation,
        writer: BlobWriter | None = None,
        source: str = "",
        origin: bytes = ORIGIN_SOURCE,
    ) -> None:
        self._commits.commit_sync(digest_hex, data, res, writer, source, origin)

    # ---- access, pins, eviction --------------------------------------------------------

    def touch(
        self, digest_hex: str, model_key: str | None = None, layer: int = -1, expert: int = -1,
        *, policy: bool = True,
    ) -> None:
        """Record one access (a hit if present, else a miss); stats are batched to the index.
        ``policy=False`` records the statistics only: the caller tells the policy later."""
        digest = validate_digest(digest_hex)
        if policy:
            self.ledger.touch(digest)
        self.index.record_access(digest, model_key, layer, expert, time.time())

    def policy_touch(self, digest: str) -> None:
        """Tell the policy of one use whose statistics ``touch(policy=False)`` recorded earlier."""
        self.ledger.touch(digest)

    def hold(self, digests: Iterable[str]) -> None:
        """Spare ``digests`` from eviction (a request under way) until ``release_hold``."""
        self.ledger.hold(digests)

    def release_hold(self, digests: Iterable[str]) -> None:
        self.ledger.release_hold(digests)

    def removals(self) -> int:
        """How many blobs eviction and quarantine have taken since start: a change means an fd
        held for a blob may be stale."""
        counters = self.ledger.counters
        return counters.get("evictions", 0) + counters.get("quarantined", 0)

    async def pin(self, digest_hex: str) -> None:
        """Never evict this digest (it may be pinned before it is fetched)."""
        digest = validate_digest(digest_hex)
        with self.ledger.mu:
            self.ledger.pins.add(digest)
        await asyncio.wrap_future(self.index.set_pin(digest, True))

    async def unpin(self, digest_hex: str) -> None:
        digest = validate_digest(digest_hex)
        with self.ledger.mu:
            self.ledger.pins.discard(digest)
        await asyncio.wrap_future(self.index.set_pin(digest, False))

    def pins(self) -> set[str]:
        with self.ledger.mu:
            return set(self.ledger.pins)

    async def evict(self, digests: list[str] | None = None, nbytes: int = 0) -> int:
        """Evict the given digests (pinned ones are skipped), or ``nbytes`` by policy, or
        (neither given) down to the budget. Returns the bytes freed."""
        wanted = [validate_digest(d) for d in digests] if digests is not None else None
        return await asyncio.to_thread(self.evict_sync, wanted, nbytes)

    def evict_sync(self, digests: list[str] | None = None, nbytes: int = 0) -> int:
        return self._remove(self.ledger.take(digests, nbytes))

    def _remove(self, victims: Victims) -> int:
        """Rows first, then files: a crash in between leaves strays, never dangling rows."""
        if not victims.where:
            return 0
        try:
            self.index.delete_entries(list(victims.where)).result()
        except errors.CachecdError as exc:
            # Unlink anyway: disk space is what the budget protects. A row left behind is
            # dropped by open_blob or by recovery at the next open.
            log.error("event=evict_row_delete_failed n=%d err=%s", len(victims.where), exc)
        try:
            for d, entry in victims.where.items():
                self.blobs.unlink(entry.dir_index, d)
        finally:
            freed = self.ledger.settle(victims)
        log.debug("event=evicted n=%d bytes=%d", len(victims.where), freed)
        return freed

    async def quarantine(self, digest_hex: str) -> None:
        """A verified read found bit rot: move the file aside and drop the row."""
        digest = validate_digest(digest_hex)
        await asyncio.to_thread(self.quarantine_sync, digest)

    def quarantine_sync(self, digest: str) -> None:
        self._integrity.quarantine_sync(digest)

    # ---- reports and models ------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        out = self.ledger.snapshot()
        out["dirs"] = [
            {"path": str(d.root), "free_bytes": d.free_bytes()} for d in self.blobs.dirs
        ]
        out["index_map_size"] = self.index.env.info()["map_size"]
        return out

    def access_counts(self, model_key: str) -> dict[tuple[int, int], tuple[int, float]]:
        """(layer, expert) -> (count, last use) for one model, including unflushed accesses."""
        return self.index.access_counts(model_key)

    def put_model(self, key: str, record: dict[str, Any]) -> Future[None]:
        """Visible to ``get_model`` at once; durable when the returned Future completes
        (``await asyncio.wrap_future(...)`` from async code)."""
        return self._models.put(key, record)

    def delete_model(self, key: str) -> Future[None]:
        return self._models.delete(key)

    def get_model(self, key: str) -> dict[str, Any] | None:
        return self._models.get(key)

    def models(self) -> list[dict[str, Any]]:
        """Every registered model record, each with its ``key`` added."""
        return self._models.all()


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off while a block builds many objects that live on: opening a
    K3-sized cache makes ~10^5 (rows, the policy's entries), and the collector walked them again
    and again as they were made, a fifth of the open. They form no cycles; it runs again after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

