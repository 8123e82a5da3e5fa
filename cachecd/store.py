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
- An eviction never cuts off a read in progress: a reader holds an fd from ``open_blob`` and the
  kernel keeps an unlinked file's bytes until the last fd closes. No reader refcount is needed.
- In-memory state (entries, policy, budget, pins, models) is guarded by one lock; ``has`` and
  ``size_of`` read a dict without it (atomic in CPython). Blocking work (file I/O, fsync,
  hashing, LMDB commits) runs in threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from cachecd import errors
from cachecd.blobs import BlobDirs, validate_digest
from cachecd.budget import Budget, Reservation
from cachecd.crash import crash_point
from cachecd.index import INDEX_DIRNAME, Entry, Index
from cachecd.policies import EvictionPolicy, make_policy
from cachecd.recovery import RecoveryReport, mark_clean, recover

log = logging.getLogger(__name__)

_RESTORED_HITS_CAP = 8


class Store:
    def __init__(
        self, blobs: BlobDirs, index: Index, budget: Budget, policy: EvictionPolicy,
        report: RecoveryReport, entries: dict[str, Entry],
    ) -> None:
        self.blobs = blobs
        self.index = index
        self.budget = budget
        self.policy = policy
        self.recovery = report
        self._mu = threading.RLock()
        self._entries = entries
        self._pins = index.load_pins()
        self._models = index.load_models()
        self._counters = dict.fromkeys(
            ("hits", "misses", "inserts", "evictions", "bytes_evicted", "quarantined"), 0
        )
        self._unlinking: dict[str, threading.Event] = {}
        self._closed = False
        counts = index.load_digest_access()
        for digest, entry in sorted(entries.items(), key=lambda kv: counts.get(kv[0], (0, 0))[1]):
            # Lifetime counts are capped: the policy's aging restarts at 0, and an expert that
            # was hot last month must not outrank today's hot set for weeks.
            hits = min(counts.get(digest, (0, 0.0))[0], _RESTORED_HITS_CAP)
            policy.on_insert(digest, entry.size, hits)
            budget.add_used(entry.size)

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
        the_budget, the_policy = Budget(budget), make_policy(policy)
        blobs = BlobDirs([Path(d) for d in dirs])
        index: Index | None = None
        try:
            index = Index(
                Path(dirs[0]) / INDEX_DIRNAME, map_size=map_size, map_ceiling=map_ceiling
            )
            report, entries = recover(blobs, index, full=full_recovery)
            store = cls(blobs, index, the_budget, the_policy, report, entries)
            report.bytes_evicted = store.evict_sync()
            report.evicted = store._counters["evictions"]
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
        return validate_digest(digest_hex) in self._entries

    def size_of(self, digest_hex: str) -> int | None:
        entry = self._entries.get(validate_digest(digest_hex))
        return entry.size if entry else None

    def open_blob(self, digest_hex: str) -> tuple[int, int]:
        """(fd, size) of a committed blob; the caller closes the fd.

        A blob whose file is gone or has the wrong size loses its row (the file, if any, goes
        to quarantine/) and ``ExpertNotFound`` is raised, so the caller refetches.
        """
        digest = validate_digest(digest_hex)
        entry = self._entries.get(digest)
        if entry is None:
            raise errors.ExpertNotFound(f"blob {digest} is not in the cache")
        try:
            fd, size = self.blobs.open_read(entry.dir_index, digest)
        except (FileNotFoundError, IsADirectoryError) as exc:
            self._drop(digest, entry, quarantine=False)
            raise errors.ExpertNotFound(f"blob {digest} vanished from the cache ({exc})") from exc
        except OSError as exc:
            if exc.errno != errno.ELOOP:  # EMFILE, EIO...: not the blob's fault, keep it
                raise errors.Internal(f"cannot open blob {digest}: {exc}") from exc
            self._drop(digest, entry, quarantine=True)  # a symlink planted at a blob path
            raise errors.ExpertNotFound(f"blob {digest} was not a regular file") from exc
        if size != entry.size:
            os.close(fd)
            self._drop(digest, entry, quarantine=True)
            raise errors.ExpertNotFound(
                f"blob {digest} has {size} bytes on disk, expected {entry.size}; refetch it"
            )
        return fd, size

    def _drop(self, digest: str, entry: Entry, *, quarantine: bool) -> None:
        with self._mu:
            if self._entries.get(digest) is not entry:
                return  # someone else already dropped or replaced it
            self._forget([digest])
            if quarantine:
                self.blobs.quarantine(entry.dir_index, digest, "bad_on_open")
                self._counters["quarantined"] += 1
            _log_failure(self.index.delete_entries([digest]), "drop_row")
        log.warning("event=blob_dropped digest=%s quarantined=%s", digest, quarantine)

    # ---- writing -----------------------------------------------------------------------

    async def reserve(self, nbytes: int) -> Reservation:
        """Room for ``nbytes``; evicts (unlinks) victims before returning.

        Raises ``TooLarge`` (never fits) or ``ReservationsFull`` (retry later).
        """
        return await asyncio.to_thread(self.reserve_sync, nbytes)

    def reserve_sync(self, nbytes: int) -> Reservation:
        with self._mu:
            res, victims = self.budget.reserve(nbytes, self._pick, self._release)
            detached = self._detach(victims)
        self._finish_eviction(detached)
        return res

    def _release(self, res: Reservation) -> None:
        with self._mu:
            self.budget.release(res)

    async def commit(
        self, digest_hex: str, data: bytes | memoryview, reservation: Reservation
    ) -> None:
        """Write, fsync, rename, index. The reservation ends here (used or released).

        Runs to completion in a thread even if the awaiting task is cancelled, so the blob, its
        row and the budget always agree.
        """
        try:
            digest = validate_digest(digest_hex)
        except errors.InvalidRequest:
            reservation.release()
            raise
        await asyncio.shield(asyncio.to_thread(self.commit_sync, digest, data, reservation))

    def commit_sync(self, digest_hex: str, data: bytes | memoryview, res: Reservation) -> None:
        try:
            digest = validate_digest(digest_hex)
            nbytes = memoryview(data).nbytes
            if res.done:
                raise errors.Internal("commit with a reservation that already ended")
            if nbytes > res.nbytes:
                raise errors.InvalidRequest(
                    f"blob of {nbytes} bytes exceeds its reservation of {res.nbytes}"
                )
            with self._mu:
                present, unlinking = digest in self._entries, self._unlinking.get(digest)
            if present:
                res.release()
                return
            if unlinking is not None:
                unlinking.wait()  # an eviction of these same bytes must not unlink our file
            self._write_and_index(digest, data, nbytes, res)
        except BaseException:
            res.release()
            raise

    def _write_and_index(
        self, digest: str, data: bytes | memoryview, nbytes: int, res: Reservation
    ) -> None:
        try:
            entry = self._write_once(digest, data, nbytes)
        except errors.DiskFull:
            # With no byte budget the free space is the budget: make room by policy and try
            # once more. With a budget the operator sized the cache; a full disk is theirs.
            if self.budget.limit or not self.evict_sync(nbytes=2 * nbytes + 1):
                raise
            log.warning("event=disk_full_evicted digest=%s", digest)
            entry = self._write_once(digest, data, nbytes)
        crash_point("after_index_commit")
        with self._mu:
            if digest in self._entries:
                self.budget.release(res)  # a racing commit of the same bytes won
                return
            self.budget.commit(res, nbytes)
            self._entries[digest] = entry
            self.policy.on_insert(digest, nbytes)
            self._counters["inserts"] += 1

    def _write_once(self, digest: str, data: bytes | memoryview, nbytes: int) -> Entry:
        dir_index = self.blobs.write_blob(digest, data)
        crash_point("before_index_commit")
        entry = Entry(dir_index, nbytes, time.time())
        try:
            self._put_row(digest, entry)
        except BaseException:
            # The row did not commit: take the file back so it neither counts as a stray nor
            # eats disk outside the budget.
            self.blobs.unlink(dir_index, digest)
            raise
        return entry

    def _put_row(self, digest: str, entry: Entry) -> None:
        try:
            self.index.put_entry(digest, entry).result()
        except errors.IndexFull:
            # The map is at its ceiling: make room by evicting a slice of the cache, then
            # try once more; if that is not enough the caller gets a retryable 507.
            if not self._evict_for_index():
                raise
            log.warning("event=index_full_evicted digest=%s", digest)
            self.index.put_entry(digest, entry).result()

    def _evict_for_index(self) -> int:
        with self._mu:
            victims = self._pick(max(self.budget.used // 64, 1))
            self.budget.remove_used(sum(size for _, size in victims))
            detached = self._detach(victims)
        return self._finish_eviction(detached)

    # ---- access, pins, eviction --------------------------------------------------------

    def touch(
        self, digest_hex: str, model_key: str | None = None, layer: int = -1, expert: int = -1
    ) -> None:
        """Record one access (a hit if present, else a miss); stats are batched to the index."""
        digest = validate_digest(digest_hex)
        with self._mu:
            if digest in self._entries:
                self.policy.on_access(digest)
                self._counters["hits"] += 1
            else:
                self._counters["misses"] += 1
        self.index.record_access(digest, model_key, layer, expert, time.time())

    async def pin(self, digest_hex: str) -> None:
        """Never evict this digest (it may be pinned before it is fetched)."""
        digest = validate_digest(digest_hex)
        with self._mu:
            self._pins.add(digest)
        await asyncio.wrap_future(self.index.set_pin(digest, True))

    async def unpin(self, digest_hex: str) -> None:
        digest = validate_digest(digest_hex)
        with self._mu:
            self._pins.discard(digest)
        await asyncio.wrap_future(self.index.set_pin(digest, False))

    def pins(self) -> set[str]:
        with self._mu:
            return set(self._pins)

    async def evict(self, digests: list[str] | None = None, nbytes: int = 0) -> int:
        """Evict the given digests (pinned ones are skipped), or ``nbytes`` by policy, or
        (neither given) down to the budget. Returns the bytes freed."""
        wanted = [validate_digest(d) for d in digests] if digests is not None else None
        return await asyncio.to_thread(self.evict_sync, wanted, nbytes)

    def evict_sync(self, digests: list[str] | None = None, nbytes: int = 0) -> int:
        with self._mu:
            if digests is not None:
                victims = [
                    (d, self._entries[d].size)
                    for d in dict.fromkeys(digests)
                    if d in self._entries and d not in self._pins
                ]
            else:
                victims = self._pick(nbytes if nbytes > 0 else max(self.budget.overflow(), 0))
            self.budget.remove_used(sum(size for _, size in victims))
            detached = self._detach(victims)
        return self._finish_eviction(detached)

    def _pick(self, need: int) -> list[tuple[str, int]]:
        if need <= 0:
            return []
        names = self.policy.victims(need, self._pins)
        return [(d, self._entries[d].size) for d in names]

    def _detach(self, victims: list[tuple[str, int]]) -> _Detached:
        """Under _mu, with the victims' bytes already out of ``budget.used``: forget them and
        queue their row deletes. The files go in ``_finish_eviction``, outside the lock."""
        detached = _Detached(victims)
        if not victims:
            return detached
        for d, _ in victims:
            detached.where[d] = self._entries.pop(d).dir_index
            self.policy.on_remove(d)
            self._unlinking[d] = detached.done
        detached.rows = self.index.delete_entries(list(detached.where))
        return detached

    def _finish_eviction(self, detached: _Detached) -> int:
        """Rows first, then files: a crash in between leaves strays, never dangling rows."""
        if not detached.victims:
            return 0
        try:
            assert detached.rows is not None
            detached.rows.result()
        except errors.CachecdError as exc:
            # Unlink anyway: disk space is what the budget protects. A row left behind is
            # dropped by open_blob or by recovery at the next open.
            log.error("event=evict_row_delete_failed n=%d err=%s", len(detached.where), exc)
        try:
            for d, dir_index in detached.where.items():
                self.blobs.unlink(dir_index, d)
        finally:
            with self._mu:
                for d in detached.where:
                    if self._unlinking.get(d) is detached.done:
                        del self._unlinking[d]
            detached.done.set()
        freed = sum(size for _, size in detached.victims)
        with self._mu:
            self._counters["evictions"] += len(detached.victims)
            self._counters["bytes_evicted"] += freed
        log.debug("event=evicted n=%d bytes=%d", len(detached.victims), freed)
        return freed

    def _forget(self, digests: Iterable[str]) -> None:
        for d in digests:
            entry = self._entries.pop(d, None)
            if entry is not None:
                self.policy.on_remove(d)
                self.budget.remove_used(entry.size)

    async def quarantine(self, digest_hex: str) -> None:
        """A verified read found bit rot: move the file aside and drop the row."""
        digest = validate_digest(digest_hex)
        await asyncio.to_thread(self.quarantine_sync, digest)

    def quarantine_sync(self, digest: str) -> None:
        with self._mu:
            entry = self._entries.get(digest)
            if entry is None:
                return
            self._forget([digest])
            fut = self.index.delete_entries([digest])
            self.blobs.quarantine(entry.dir_index, digest, "bit_rot")
            self._counters["quarantined"] += 1
        fut.result()

    # ---- reports and models ------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._mu:
            pinned_bytes = sum(self._entries[d].size for d in self._pins if d in self._entries)
            out: dict[str, Any] = {
                "entries": len(self._entries),
                "bytes": self.budget.used,
                "budget": self.budget.limit,
                "reserved": self.budget.reserved,
                "pinned": len(self._pins),
                "pinned_bytes": pinned_bytes,
                "policy": self.policy.name,
                **self._counters,
            }
        out["dirs"] = [
            {"path": str(d.root), "free_bytes": d.free_bytes()} for d in self.blobs.dirs
        ]
        out["index_map_size"] = self.index.env.info()["map_size"]
        return out

    def digests(self) -> list[str]:
        with self._mu:
            return list(self._entries)

    def access_counts(self, model_key: str) -> dict[tuple[int, int], tuple[int, float]]:
        """(layer, expert) -> (count, last use) for one model, including unflushed accesses."""
        return self.index.access_counts(model_key)

    def put_model(self, key: str, record: dict[str, Any]) -> Future[None]:
        """Visible to ``get_model`` at once; durable when the returned Future completes
        (``await asyncio.wrap_future(...)`` from async code)."""
        with self._mu:
            self._models[key] = dict(record)
        fut = self.index.put_model(key, record)
        _log_failure(fut, "put_model")
        return fut

    def delete_model(self, key: str) -> Future[None]:
        with self._mu:
            self._models.pop(key, None)
        return self.index.delete_model(key)

    def get_model(self, key: str) -> dict[str, Any] | None:
        with self._mu:
            rec = self._models.get(key)
            return dict(rec) if rec is not None else None

    def models(self) -> list[dict[str, Any]]:
        """Every registered model record, each with its ``key`` added."""
        with self._mu:
            return [{**rec, "key": key} for key, rec in sorted(self._models.items())]


class _Detached:
    """Victims taken out of memory whose rows and files are still being removed."""

    def __init__(self, victims: list[tuple[str, int]]) -> None:
        self.victims = victims
        self.where: dict[str, int] = {}
        self.rows: Future[None] | None = None
        self.done = threading.Event()


def _log_failure(fut: Future[None], what: str) -> None:
    def done(f: Future[None]) -> None:
        if f.exception() is not None:
            log.error("event=index_write_failed what=%s err=%s", what, f.exception())

    fut.add_done_callback(done)
