"""The store: the one object the daemon uses for cached expert bytes.

It ties together the blob files (blobs.py), the LMDB index (index.py), the byte budget
(budget.py) and an eviction policy (policies.py), and runs recovery (recovery.py) at open.

Invariants:
- No index row without a complete, fsynced, renamed blob: a commit writes the blob, fsyncs it,
  renames it, fsyncs the dir, and only then commits the row.
- A blob on disk without a row is a stray: recovery adopts it (hash == name) or quarantines it
  at the next open. Eviction deletes the row first, then the file, so a crash between the two
  leaves a stray, never a dangling row.
- Usage <= budget + reservations, and usage + reservations <= budget once ``reserve`` returns:
  the bytes a reservation needs are evicted (unlinked) before ``reserve`` returns.
- A blob is hashed against its name before this process first serves it, unless this process
  committed it (its bytes were verified on the way in): rot that happened while no daemon ran
  is caught on first open (quarantine, row dropped, refetch). A blob is hashed again when it
  is opened ``constants.REVERIFY_AFTER_S`` (a day) after its last hash. Hits through an fd the
  daemon already holds are zero-copy and not re-hashed: rot under a blob in constant use is
  caught by the background scrub (scrub.py), which hashes every blob in turn, or by
  ``cachecd fsck``. A quarantine takes the blob out of the ledger before anything else, and
  bumps ``quarantine_seq``, so a request that opened the blob earlier can tell and open again.
- An eviction never cuts off a read in progress: a reader holds an fd from ``open_blob`` and the
  kernel keeps an unlinked file's bytes until the last fd closes. No reader refcount is needed.
- In-memory state (entries, policy, budget, pins) lives in the ``Ledger`` (budget.py) under one
  lock; ``has`` and ``size_of`` read its dict without it (atomic in CPython). Blocking work
  (file I/O, fsync, hashing, LMDB commits) runs in threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cachecd import constants, errors
from cachecd.store import sources
from cachecd.store.blobs import BlobDirs, BlobWriter, hash_fd, validate_digest
from cachecd.store.budget import Budget, Reservation
from cachecd.store.crash import crash_point
from cachecd.store.index import INDEX_DIRNAME, Entry, Index
from cachecd.store.ledger import Ledger, Victims
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
        self._models = index.load_models()
        self._models_mu = threading.Lock()
        self._closed = False
        self._verified: dict[str, float] = {}  # blob -> when this process last hashed it
        self.quarantine_seq = 0  # bumped by every quarantine
        self._quarantined: dict[str, int] = {}  # blob -> quarantine_seq of its last quarantine

    @property
    def budget(self) -> Budget:
        return self.ledger.budget

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
        with self.ledger.mu:
            return any(self._quarantined.get(d, 0) > seq for d in digests)

    def digests(self) -> list[str]:
        with self.ledger.mu:
            return list(self.ledger.entries)

    def open_blob(self, digest_hex: str) -> tuple[int, int]:
        """(fd, size) of a committed blob; the caller closes the fd.

        A blob whose file is gone or has the wrong size loses its row (a wrong one goes to
        quarantine/) and ``ExpertNotFound`` is raised, so the caller refetches.
        """
        digest = validate_digest(digest_hex)
        entry = self.ledger.entries.get(digest)
        if entry is None:
            raise errors.ExpertNotFound(f"blob {digest} is not in the cache")
        try:
            fd, size = self.blobs.open_read(entry.dir_index, digest)
        except (FileNotFoundError, IsADirectoryError) as exc:
            self._drop(digest, entry, quarantine=False, missing=True)
            raise errors.ExpertNotFound(f"blob {digest} vanished from the cache ({exc})") from exc
        except OSError as exc:
            if exc.errno != errno.ELOOP:  # EMFILE, EIO...: not the blob's fault, keep it
                raise errors.Internal(f"cannot open blob {digest}: {exc}") from exc
            self._drop(digest, entry, quarantine=True, missing=True)  # a symlink planted there
            raise errors.ExpertNotFound(f"blob {digest} was not a regular file") from exc
        if size != entry.size:
            os.close(fd)
            self._drop(digest, entry, quarantine=True, missing=True)
            raise errors.ExpertNotFound(
                f"blob {digest} has {size} bytes on disk, expected {entry.size}; refetch it"
            )
        return fd, size

    def unverified(self, digest: str) -> bool:
        """True until this process hashed the blob's bytes (its commit or an open did), and
        again once that hash is older than ``constants.REVERIFY_AFTER_S``."""
        when = self._verified.get(digest)
        return when is None or time.monotonic() - when > constants.REVERIFY_AFTER_S

    def verify_open_blob(self, digest: str, fd: int) -> None:
        """Hash an opened blob against its name, its xxh3-128, and close ``fd``. Rot goes to
        quarantine/ and raises ``ExpertNotFound`` so the caller refetches. Blocking (reads the
        whole blob): a thread's work."""
        try:
            got, _ = hash_fd(fd)
        finally:
            os.close(fd)
        with self.ledger.mu:
            self.ledger.counters["verified_on_open" if got == digest else "bit_rot_on_open"] += 1
        if got == digest:
            self._verified[digest] = time.monotonic()
            return
        log.error("event=bit_rot_on_open digest=%s got=%s", digest, got)
        self.quarantine_sync(digest)
        raise errors.ExpertNotFound(
            f"blob {digest} failed its hash when opened (bit rot); quarantined, fetch it again"
        )

    def scrub_verdict(self, digest: str, entry: Entry, got: str) -> bool:
        """The scrub hashed ``entry``'s blob to ``got``: True if that is its name. Otherwise the
        blob goes to quarantine/ and loses its row, unless the row is no longer ``entry``."""
        if got == digest:
            self._verified[digest] = time.monotonic()
            return True
        self._drop(digest, entry, quarantine=True, why="scrub")
        log.error("event=scrub_bit_rot digest=%s got=%s", digest, got)
        return False

    def _drop(
        self, digest: str, entry: Entry, *, quarantine: bool, why: str = "bad_on_open",
        missing: bool = False,
    ) -> None:
        """Forget ``entry``'s row (and move its file to quarantine/); ``missing``: an open found
        its file gone, short or not a file (``missing_on_open``)."""
        # Under the ledger lock so the row delete is queued before any later re-commit's put.
        with self.ledger.mu:
            if self.ledger.forget(digest, entry) is None:
                return  # someone else already dropped or replaced it
            if quarantine:
                self.quarantine_seq += 1
                self._quarantined[digest] = self.quarantine_seq
                self.blobs.quarantine(entry.dir_index, digest, why)
                # Its bytes stay on the disk: they stay in the budget until quarantine/ prunes
                # them (less than the entry held, so nothing needs evicting for it).
                self.ledger.budget.set_aside = self.blobs.quarantine_bytes()
                self.ledger.counters["quarantined"] += 1
            if missing:
                self.ledger.counters["missing_on_open"] += 1
            fut = self.index.delete_entries([digest])
        _log_failure(fut, "drop_row")
        log.warning("event=blob_dropped digest=%s quarantined=%s", digest, quarantine)

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
        try:
            digest = validate_digest(digest_hex)
            if data is None and writer is None:
                raise errors.Internal(f"commit of {digest} with neither bytes nor a writer")
            nbytes = writer.nbytes if data is None else memoryview(data).nbytes  # type: ignore[union-attr]
            if res.done:
                raise errors.Internal("commit with a reservation that already ended")
            if nbytes > res.nbytes:
                raise errors.InvalidRequest(
                    f"blob of {nbytes} bytes exceeds its reservation of {res.nbytes}"
                )
            with self.ledger.mu:
                present = digest in self.ledger.entries
                unlinking = self.ledger.unlinking.get(digest)
            if present:
                res.release()
                if self.add_source(digest, source, origin):
                    return
                res = self.reserve_sync(nbytes)  # evicted since: store the bytes after all
            if unlinking is not None:
                unlinking.wait()  # an eviction of these same bytes must not unlink our file
            entry = self._write_and_index(digest, data, nbytes, writer, (source, origin))
            crash_point("after_index_commit")
            self.ledger.insert(digest, entry, res, source)
            self._verified[digest] = time.monotonic()
        except BaseException:
            res.release()
            raise
        finally:
            if writer is not None:
                writer.abort()  # a no-op once it was finished

    def _write_and_index(
        self, digest: str, data: bytes | memoryview | None, nbytes: int, writer: BlobWriter | None,
        source: tuple[str, bytes],
    ) -> Entry:
        # nbytes is the writer's own when it holds the bytes (commit): only its name can differ.
        if writer is not None and writer.digest != digest:
            raise errors.Internal(f"blob writer for {writer.digest} used to commit {digest}")
        try:
            return self._write_once(digest, data, nbytes, source, writer)
        except errors.DiskFull:
            # With no byte budget the free space is the budget: make room by policy and try
            # once more. With a budget the operator sized the cache; a full disk is theirs.
            if data is None or self.budget.limit or not self.evict_sync(nbytes=2 * nbytes + 1):
                raise
            log.warning("event=disk_full_evicted digest=%s", digest)
            return self._write_once(digest, data, nbytes, source)

    def _write_once(
        self,
        digest: str,
        data: bytes | memoryview | None,
        nbytes: int,
        source: tuple[str, bytes],
        writer: BlobWriter | None = None,
    ) -> Entry:
        # The source first: "those shard bytes hash to this digest" is true whatever becomes of
        # the file, and a blob that recovery adopts after a crash before its row (a stray) then
        # still serves the expert it was verified as (sources.py).
        self._index_write(digest, lambda: sources.put(self.index, [(digest, *source)]))
        if writer is not None:
            dir_index = writer.finish()
        else:
            dir_index = self.blobs.write_blob(digest, data)  # type: ignore[arg-type]
        crash_point("before_index_commit")
        entry = Entry(dir_index, nbytes, time.time())
        try:
            self._index_write(digest, lambda: self.index.put_entry(digest, entry, source))
        except BaseException:
            # The row did not commit: take the file back so it neither counts as a stray nor
            # eats disk outside the budget.
            self.blobs.unlink(dir_index, digest)
            raise
        return entry

    def _index_write(self, digest: str, submit: Callable[[], Future[None]]) -> None:
        try:
            submit().result()
        except errors.IndexFull:
            # The map is at its ceiling: evict a slice of the cache (deletes may use the map's
            # slack), then try once more; if that is not enough the caller gets a 507.
            if not self.evict_sync(nbytes=max(self.budget.used // 64, 1)):
                raise
            log.warning("event=index_full_evicted digest=%s", digest)
            submit().result()

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
        entry = self.ledger.entries.get(digest)
        if entry is not None:
            self._drop(digest, entry, quarantine=True, why="bit_rot")

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
        with self._models_mu:
            self._models[key] = dict(record)
        fut = self.index.put_model(key, record)
        _log_failure(fut, "put_model")
        return fut

    def delete_model(self, key: str) -> Future[None]:
        with self._models_mu:
            self._models.pop(key, None)
        return self.index.delete_model(key)

    def get_model(self, key: str) -> dict[str, Any] | None:
        with self._models_mu:
            rec = self._models.get(key)
            return dict(rec) if rec is not None else None

    def models(self) -> list[dict[str, Any]]:
        """Every registered model record, each with its ``key`` added."""
        with self._models_mu:
            return [{**rec, "key": key} for key, rec in sorted(self._models.items())]


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


def _log_failure(fut: Future[None], what: str) -> None:
    def done(f: Future[None]) -> None:
        if f.exception() is not None:
            log.error("event=index_write_failed what=%s err=%s", what, f.exception())

    fut.add_done_callback(done)
