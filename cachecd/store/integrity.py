"""Whether a cached blob still holds the bytes its name says: the hashes on open and by the
scrub, and the rows dropped (the files quarantined) when it does not. ``Store`` delegates its
``open_blob``, ``unverified``, ``verify_open_blob``, ``scrub_verdict`` and ``quarantine`` here.

Invariants:
- A blob is hashed against its name before this process first serves it, unless this process
  committed it (its bytes were verified on the way in): rot that happened while no daemon ran
  is caught on first open (quarantine, row dropped, refetch). A blob is hashed again when it
  is opened ``constants.REVERIFY_AFTER_S`` (a day) after its last hash. Hits through an fd the
  daemon already holds are zero-copy and not re-hashed: rot under a blob in constant use is
  caught by the background scrub (scrub.py), which hashes every blob in turn, or by
  ``cachecd fsck``. A quarantine takes the blob out of the ledger before anything else, and
  bumps ``quarantine_seq``, so a request that opened the blob earlier can tell and open again.
- The engine's reads hash every expert as it lands (``cachecd_client``'s ``digests``), so
  rot under a blob in use is caught at its next read: the client reports it (``recheck``),
  and the blob is quarantined only if this process's own hash of it fails too. A report
  alone moves nothing, so no client can evict a good blob by claiming it is bad.
"""

from __future__ import annotations

import errno
import logging
import os
import time

from cachecd import constants, errors
from cachecd.store.blobs import BlobDirs, hash_fd, validate_digest
from cachecd.store.index import Entry, Index, log_failure
from cachecd.store.ledger import Ledger

log = logging.getLogger(__name__)


class BlobIntegrity:
    def __init__(self, blobs: BlobDirs, index: Index, ledger: Ledger) -> None:
        self.blobs = blobs
        self.index = index
        self.ledger = ledger
        self.verified: dict[str, float] = {}  # blob -> when this process last hashed it
        self.quarantine_seq = 0  # bumped by every quarantine
        self._quarantined: dict[str, int] = {}  # blob -> quarantine_seq of its last quarantine

    def quarantined_since(self, seq: int, digests: list[str]) -> bool:
        """Whether any of ``digests`` was quarantined after ``quarantine_seq`` was ``seq``."""
        with self.ledger.mu:
            return any(self._quarantined.get(d, 0) > seq for d in digests)

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
            self.drop(digest, entry, quarantine=False, missing=True)
            raise errors.ExpertNotFound(f"blob {digest} vanished from the cache ({exc})") from exc
        except OSError as exc:
            if exc.errno != errno.ELOOP:  # EMFILE, EIO...: not the blob's fault, keep it
                raise errors.Internal(f"cannot open blob {digest}: {exc}") from exc
            self.drop(digest, entry, quarantine=True, missing=True)  # a symlink planted there
            raise errors.ExpertNotFound(f"blob {digest} was not a regular file") from exc
        if size != entry.size:
            os.close(fd)
            self.drop(digest, entry, quarantine=True, missing=True)
            raise errors.ExpertNotFound(
                f"blob {digest} has {size} bytes on disk, expected {entry.size}; refetch it"
            )
        return fd, size

    def unverified(self, digest: str) -> bool:
        """True until this process hashed the blob's bytes (its commit or an open did), and
        again once that hash is older than ``constants.REVERIFY_AFTER_S``."""
        when = self.verified.get(digest)
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
            self.verified[digest] = time.monotonic()
            return
        log.error("event=bit_rot_on_open digest=%s got=%s", digest, got)
        self.quarantine_sync(digest)
        raise errors.ExpertNotFound(
            f"blob {digest} failed its hash when opened (bit rot); quarantined, fetch it again"
        )

    def recheck(self, digest_hex: str) -> str:
        """A reader found this blob's bytes wrong: hash it again here. ``"good"`` (kept, its
        hash renewed), ``"quarantined"`` (it failed: to quarantine/, row dropped) or
        ``"absent"`` (not cached, or dropped as gone or short). Blocking: a thread's work."""
        digest = validate_digest(digest_hex)
        try:
            fd, _ = self.open_blob(digest)
        except errors.ExpertNotFound:
            return "absent"
        try:
            got, _ = hash_fd(fd)
        finally:
            os.close(fd)
        with self.ledger.mu:
            self.ledger.counters["rechecked_good" if got == digest else "bit_rot_on_read"] += 1
        if got == digest:
            self.verified[digest] = time.monotonic()
            log.warning("event=recheck_good digest=%s (the reader's bytes were wrong, the "
                        "blob's are not: check the reader's memory)", digest)
            return "good"
        log.error("event=bit_rot_on_read digest=%s got=%s", digest, got)
        entry = self.ledger.entries.get(digest)
        if entry is not None:
            self.drop(digest, entry, quarantine=True, why="bit_rot_on_read")
        return "quarantined"

    def scrub_verdict(self, digest: str, entry: Entry, got: str) -> bool:
        """The scrub hashed ``entry``'s blob to ``got``: True if that is its name. Otherwise the
        blob goes to quarantine/ and loses its row, unless the row is no longer ``entry``."""
        if got == digest:
            self.verified[digest] = time.monotonic()
            return True
        self.drop(digest, entry, quarantine=True, why="scrub")
        log.error("event=scrub_bit_rot digest=%s got=%s", digest, got)
        return False

    def quarantine_sync(self, digest: str) -> None:
        entry = self.ledger.entries.get(digest)
        if entry is not None:
            self.drop(digest, entry, quarantine=True, why="bit_rot")

    def drop(
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
        log_failure(fut, "drop_row")
        log.warning("event=blob_dropped digest=%s quarantined=%s", digest, quarantine)
