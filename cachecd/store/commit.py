"""The write path: verified bytes made a blob file and an index row. ``Store.commit`` runs
``BlobCommitter.commit_sync`` in a thread.

Invariants:
- No index row without a complete, fsynced, renamed blob: a commit writes the blob, fsyncs it,
  renames it, fsyncs the dir, and only then commits the row.
- A blob this process committed is not hashed again before it is served (its bytes were
  verified on the way in): the commit marks it verified (``integrity.py``).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from cachecd import errors
from cachecd.store import sources
from cachecd.store.blobs import BlobDirs, BlobWriter, validate_digest
from cachecd.store.budget import Reservation
from cachecd.store.crash import crash_point
from cachecd.store.index import Entry, Index
from cachecd.store.ledger import Ledger
from cachecd.store.sources import ORIGIN_SOURCE

log = logging.getLogger(__name__)


class Room(Protocol):
    """What a commit asks of the store: room (its eviction) and a cached blob's sources."""

    def evict_sync(self, digests: list[str] | None = None, nbytes: int = 0) -> int: ...

    def reserve_sync(self, nbytes: int) -> Reservation: ...

    def add_source(self, digest: str, source: str, origin: bytes = ORIGIN_SOURCE) -> bool: ...


class BlobCommitter:
    """The store's commit; ``verified`` is the integrity's map, where it marks what it
    committed."""

    def __init__(
        self, blobs: BlobDirs, index: Index, ledger: Ledger, verified: dict[str, float],
        store: Room,
    ) -> None:
        self.blobs = blobs
        self.index = index
        self.ledger = ledger
        self._verified = verified
        # Weak: the store owns its committer, and a cycle would keep a dropped store's entries
        # and policy (~10^5 objects at K3 scale) alive until the collector runs.
        self._store: Room = weakref.proxy(store)

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
                if self._store.add_source(digest, source, origin):
                    return
                res = self._store.reserve_sync(nbytes)  # evicted since: store the bytes after all
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
            budget = self.ledger.budget
            if data is None or budget.limit or not self._store.evict_sync(nbytes=2 * nbytes + 1):
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
            if not self._store.evict_sync(nbytes=max(self.ledger.budget.used // 64, 1)):
                raise
            log.warning("event=index_full_evicted digest=%s", digest)
            submit().result()
