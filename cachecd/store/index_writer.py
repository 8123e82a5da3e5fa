"""The index's writer thread: every LMDB write txn runs on it, batched, the map grown as needed.

``Index`` (index.py) builds on it: the tables, their rows and the access statistics, which this
thread flushes (``_flush_due``, ``_flush_pending``).

Invariants:
- Every write goes through one writer thread (``submit``); callers get a Future. So when the map
  is full the writer holds no open write txn and may call ``set_mapsize`` (x2, up to a ceiling);
  read txns (any thread) take the shared side of a lock that ``set_mapsize`` and a write txn's
  abort take exclusively (py-lmdb >= 2 makes both wait for every other thread's LMDB call).
- Writes queued together commit in one txn (one fsync); if that txn fails, each job is rerun
  alone so one bad job cannot fail the others. A Future completes only after its commit.
- A failed commit leaves the index unchanged: the txn is aborted. MapFull past the ceiling raises
  ``IndexFull``; any other ``lmdb.Error`` (a full tmpfs gives ``mdb_txn_commit: Input/output
  error``) raises ``DiskFull``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from cachecd import errors
from cachecd.store.crash import crash_point
from cachecd.store.rwlock import RWLock

log = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()
FLUSH = object()  # queued by ``Index.record_access``: flush the access statistics now
_MAX_BATCH = 64
_Job = tuple[Callable[[lmdb.Transaction], Any], Future[Any], bool]


class IndexWriter:
    def __init__(self, env: lmdb.Environment, path: Path, map_ceiling: int,
                 flush_interval: float) -> None:
        self.env = env
        self.path = path
        self.map_ceiling = map_ceiling
        self._rw = RWLock()
        self._flush_interval = flush_interval
        self._flush_requested = False  # a FLUSH token is queued
        self._queue: queue.Queue[Any] = queue.Queue()
        self._closed = False
        self._submit_lock = threading.Lock()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._writer, name="cachecd-index", daemon=True)
        self._thread.start()

    # ---- the statistics the writer flushes (``Index`` has them) ------------------------

    def _flush_due(self) -> bool:
        return False

    def _flush_pending(self) -> None:
        return None

    # ---- the writer thread -------------------------------------------------------------

    def submit(self, fn: Callable[[lmdb.Transaction], T], *, frees: bool = False) -> Future[T]:
        """Run ``fn(txn)`` in one write txn on the writer thread; it may be re-run on map full.

        ``frees``: the op only deletes. LMDB needs fresh pages even to delete (copy-on-write),
        so such ops may grow the map past the ceiling by a slack; otherwise a full index could
        never be evicted from.
        """
        fut: Future[T] = Future()
        with self._submit_lock:  # nothing may be queued behind _STOP, it would never run
            if self._closed:
                fut.set_exception(errors.ShuttingDown("the index is closed"))
                return fut
            self._queue.put((fn, fut, frees))
        return fut

    def _writer(self) -> None:
        next_flush = time.monotonic() + self._flush_interval
        stop = False
        while not stop:
            try:
                item = self._queue.get(timeout=max(next_flush - time.monotonic(), 0.01))
            except queue.Empty:
                item = None
            jobs, stop = self._drain(item)
            if jobs:
                self._run_jobs(jobs)
            if self._flush_due() or time.monotonic() >= next_flush:
                # A FLUSH token ends a drain, so the stats it asked for are written before
                # any job queued after it completes.
                self._flush_pending()
                next_flush = time.monotonic() + self._flush_interval
        self._flush_pending()

    def _drain(self, item: Any) -> tuple[list[_Job], bool]:
        """``item`` plus whatever else is queued (up to a batch): one txn, one fsync for all."""
        jobs: list[_Job] = []
        stop = False
        while item is not None:
            if item is _STOP:
                stop = True
            elif item is FLUSH:
                self._flush_requested = False
                break
            elif item[1].set_running_or_notify_cancel():
                jobs.append(item)
            if stop or len(jobs) >= _MAX_BATCH:
                break
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                item = None
        return jobs, stop

    def _run_jobs(self, jobs: list[_Job]) -> None:
        if len(jobs) > 1:
            try:
                results = self._write(
                    lambda txn: [fn(txn) for fn, _, _ in jobs], all(f for _, _, f in jobs)
                )
            except BaseException as exc:  # noqa: BLE001 - rerun one by one: a bad job fails alone
                log.debug("event=index_batch_failed n=%d err=%s", len(jobs), exc)
            else:
                for (_, fut, _), result in zip(jobs, results, strict=True):
                    fut.set_result(result)
                return
        for fn, fut, frees in jobs:
            try:
                fut.set_result(self._write(fn, frees))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def _write(self, fn: Callable[[lmdb.Transaction], T], frees: bool = False) -> T:
        while True:
            try:
                txn = self.env.begin(write=True)
            except lmdb.Error as exc:
                raise errors.DiskFull(f"index write failed to start: {exc}") from exc
            try:
                result = fn(txn)
                txn.commit()
                return result
            except lmdb.MapFullError:
                self._abort(txn)
                self._grow(frees)
            except lmdb.Error as exc:
                self._abort(txn)
                log.error("event=index_commit_failed err=%s", exc)
                raise errors.DiskFull(
                    f"index commit failed ({exc}); the index is unchanged. Free space in "
                    f"{self.path.parent} and retry"
                ) from exc
            except BaseException:
                self._abort(txn)
                raise

    def _abort(self, txn: lmdb.Transaction) -> None:
        # py-lmdb >= 2 makes a write txn's abort wait until no other thread is inside an LMDB
        # call; readers that never pause would starve it for ever. Readers are held off.
        with self._rw.exclusive():
            txn.abort()

    def _grow(self, frees: bool) -> None:
        current = self.env.info()["map_size"]
        limit = self.map_ceiling + (max(self.map_ceiling // 8, 256 * 1024) if frees else 0)
        if current >= limit:
            raise errors.IndexFull(
                f"index map is at its ceiling ({self.map_ceiling} bytes); evict entries"
            )
        new = min(current * 2, limit)
        log.info("event=index_map_growing old=%d new=%d", current, new)
        with self._rw.exclusive():
            self.env.set_mapsize(new)
        crash_point("during_map_growth")  # grown, and the txn that needed it not retried yet
        log.info("event=index_map_grown old=%d new=%d", current, new)

    def close(self) -> None:
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join()
        self.env.close()

    # ---- reads (any thread) ------------------------------------------------------------

    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        with self._rw.shared(), self.env.begin(write=False, buffers=False) as txn:
            yield txn
