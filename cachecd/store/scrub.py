"""The background scrub: every cached blob hashed against its name, in turn, continuously.

ZFS and Ceph scrub their data in the background; so does the daemon. A hit is served from the
blob without re-hashing it (the zero-copy path), so a blob that rots in place (same length) while
the daemon runs is served until something hashes it again: the scrub does, pass after pass. A
blob that fails goes to quarantine/ and loses its row, so it is fetched again on next use.

Invariants:
- Rate: reads are paid for from a token bucket filled at ``rate`` bytes a second, a blob at least
  ``constants.SCRUB_MIN_BLOB_COST`` (a page). A blob is paid for before it is opened, so the
  scrub holds a blob's fd only while it reads it (at disk speed).
- The window: a pass over the cache takes at most (its bytes / ``rate``) plus
  ``constants.SCRUB_DEFER_S``, busy or not, so rot is found within one pass, as docs/daemon.md says.
- Below demand: while ``busy()`` says demand fetches are in flight, the next read waits, until
  the fetches end or the bucket is full (``SCRUB_DEFER_S`` of its rate saved up); the saved
  tokens then pay for catching up. Demand goes first; the average stays ``rate``.
- A verdict applies to the row the scrub read (``Store.scrub_verdict``): a blob evicted or
  replaced meanwhile is left alone, and not counted as missing. A bad blob leaves the ledger first, under its lock, so from
  that moment no hit is served from it (the daemon's fd cache checks the row on every hit); its
  row is deleted by the index's writer thread, the only LMDB writer.
- Opens, reads and hashing run on the scrub's own thread, never on the event loop. The bytes
  hashed are the ones a hit serves: both go through the page cache.
- Rest: a pass starts at most every ``constants.SCRUB_REST_S`` unless a blob came into the store
  since the last one began (the ledger sets ``_wake``). Between passes the thread sleeps on that
  event: an idle daemon with a small, scrubbed cache does not spin. A pass longer than the rest
  (a large cache) is followed by the next at once, so the window above holds there.
- Log: at most one ``scrub_pass_done`` line every ``constants.SCRUB_LOG_EVERY_S``; it says how
  many passes it covers (``passes``), the last one's blobs, bytes and seconds, and the failures
  of all of them. Passes held back are logged once the minute is up, resting or not.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from cachecd import constants, errors
from cachecd.store.blobs import HASH_CHUNK
from cachecd.store.store import Store

log = logging.getLogger(__name__)


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up. ``take`` may go into debt: it
    returns how long to wait before using what it took."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0:
            raise errors.InvalidRequest(f"a token bucket needs a rate above 0, got {rate}")
        self.rate, self.burst, self._clock = rate, burst, clock
        self._tokens = 0.0
        self._t = clock()

    def take(self, n: float) -> float:
        self._refill()
        self._tokens -= n
        return max(0.0, -self._tokens / self.rate)

    def full_in(self) -> float:
        """Seconds until the bucket holds ``burst`` (0: it does)."""
        self._refill()
        return max(0.0, (self.burst - self._tokens) / self.rate)

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
        self._t = now


class Scrubber:
    """Runs passes over the store on its own thread until ``stop``; ``status`` from any thread."""

    def __init__(self, store: Store, rate: int, busy: Callable[[], bool] = lambda: False,
                 *, chunk: int = HASH_CHUNK, clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.rate, self._busy, self._chunk = store, rate, busy, chunk
        self._clock = clock
        # The burst is what a busy daemon's deferral saves up, and pays back afterwards.
        burst = max(chunk, rate * constants.SCRUB_DEFER_S)
        self._bucket = TokenBucket(rate, burst) if rate > 0 else None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set when a blob comes in (and on stop): end a rest
        store.ledger.inserted.append(self._wake)
        self._unlogged: list[dict[str, Any]] = []  # passes done since the last log line
        self._logged_at: float | None = None
        self._resting_until: float | None = None  # Unix time, while the thread rests
        self._thread: threading.Thread | None = None
        self._mu = threading.Lock()
        self.counters = dict.fromkeys(("blobs", "bytes", "failures", "missing", "passes",
                                       "yields"), 0)  # yields: blobs paid for at the busy price
        self._pass: dict[str, Any] = {}
        self._last: dict[str, Any] = {}
        self._last_failure: dict[str, Any] = {}

    # ---- the thread --------------------------------------------------------------------

    def start(self) -> None:
        if self._bucket is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="cachecd-scrub", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = self._clock()
            self._wake.clear()  # a blob that comes in from now on calls for another pass
            scrubbed = 0
            try:
                scrubbed = self.run_pass()
            except Exception:  # a bug must not end the scrub for the daemon's lifetime
                log.exception("scrub pass failed")
            # An empty cache waits for its first blob, however short the rest.
            self._rest(began + max(constants.SCRUB_REST_S, 0.0 if scrubbed else 1.0))
        self._log_passes()

    def _rest(self, until: float) -> None:
        """Sleep until ``until`` (on ``clock``), a blob comes in or ``stop``; passes held back
        from the log are logged once their minute is up."""
        while not (self._wake.is_set() or self._stop.is_set()):
            now = self._clock()
            wait = until - now
            if wait <= 0:
                break
            if self._unlogged:
                due = self._log_due(now)
                if due <= 0:
                    self._log_passes()
                    continue
                wait = min(wait, due)
            with self._mu:
                self._resting_until = time.time() + (until - now)
            self._wake.wait(wait)
        with self._mu:
            self._resting_until = None

    # ---- a pass ------------------------------------------------------------------------

    def run_pass(self) -> int:
        """Hash every blob the store indexes now, once; returns how many were looked at."""
        digests = self.store.digests()
        sizes = [e.size for d in digests if (e := self.store.entry(d)) is not None]
        started = time.time()
        with self._mu:
            self._pass = {"started": started, "blobs_total": len(digests),
                          "bytes_total": sum(sizes), "blobs_done": 0, "bytes_done": 0,
                          "failures": 0}
        for digest in digests:
            if self._stop.is_set():
                return 0  # an unfinished pass is not a pass
            nbytes = self.scrub_one(digest)
            with self._mu:
                self._pass["blobs_done"] += 1
                self._pass["bytes_done"] += nbytes
        if not digests:
            return 0
        took = time.time() - started
        with self._mu:
            self.counters["passes"] += 1
            self._last = {"finished": time.time(), "seconds": round(took, 3),
                          "blobs": len(digests), "bytes": self._pass["bytes_done"],
                          "failures": self._pass["failures"]}
            self._unlogged.append(dict(self._last))
        if self._log_due(self._clock()) <= 0:
            self._log_passes()
        return len(digests)

    # ---- the log -----------------------------------------------------------------------

    def _log_due(self, now: float) -> float:
        """Seconds until the next ``scrub_pass_done`` line may go (0 or less: now)."""
        return 0.0 if self._logged_at is None else self._logged_at + constants.SCRUB_LOG_EVERY_S - now

    def _log_passes(self) -> None:
        with self._mu:
            passes, self._unlogged = self._unlogged, []
        if not passes:
            return
        last = passes[-1]
        log.info("event=scrub_pass_done passes=%d blobs=%d bytes=%d seconds=%.1f failures=%d",
                 len(passes), last["blobs"], last["bytes"], last["seconds"],
                 sum(p["failures"] for p in passes))
        self._logged_at = self._clock()

    def scrub_one(self, digest: str) -> int:
        """Hash one blob (paced, below demand) and apply the verdict; returns bytes hashed."""
        entry = self.store.entry(digest)
        if entry is None:
            return 0  # evicted since the pass began
        if self._busy():
            self._count(yields=1)
            self._defer()
        self._wait(self._bucket_take(max(entry.size, constants.SCRUB_MIN_BLOB_COST)))
        if self._stop.is_set() or self.store.entry(digest) is not entry:
            return 0  # evicted or replaced while the scrub waited for its turn
        dropped = self.store.ledger.counters["missing_on_open"]
        try:
            fd, size = self.store.open_blob(digest)
        except errors.ExpertNotFound:  # gone: missing or short (open_blob dropped it), or evicted
            if self.store.ledger.counters["missing_on_open"] != dropped:
                self._count(missing=1)
            return 0
        except errors.CachecdError as exc:  # EMFILE and the like: not the blob's fault
            log.warning("event=scrub_open_failed digest=%s err=%s", digest, exc)
            return 0
        try:
            got = self._hash(fd, size)
        except OSError as exc:  # EIO from a failing disk: a hit could not read it either
            log.error("event=scrub_read_failed digest=%s err=%s", digest, exc)
            got = f"unreadable ({exc.strerror})"
        finally:
            os.close(fd)
        if got is None:
            return 0
        if self.store.scrub_verdict(digest, entry, got):
            self._count(blobs=1, bytes=size)
        else:
            self._count(blobs=1, bytes=size, failures=1)
            with self._mu:
                self._pass["failures"] = self._pass.get("failures", 0) + 1
                self._last_failure = {"digest": digest, "at": time.time()}
        return size

    def _hash(self, fd: int, size: int) -> str | None:
        """xxh3-128 of the blob's ``size`` bytes (a short read hashes short: a mismatch)."""
        import xxhash

        h = xxhash.xxh3_128()
        offset = 0
        while offset < size:
            if self._stop.is_set():
                return None
            chunk = os.pread(fd, min(self._chunk, size - offset), offset)
            if not chunk:
                break
            h.update(chunk)
            offset += len(chunk)
        return h.hexdigest()

    # ---- pacing ------------------------------------------------------------------------

    def _bucket_take(self, n: int) -> float:
        return self._bucket.take(n) if self._bucket is not None else 0.0

    def _defer(self) -> None:
        """Wait while demand fetches are in flight, until the bucket is full: no more than
        SCRUB_DEFER_S, and the tokens saved meanwhile pay for the reads that come after."""
        while self._bucket is not None and not self._stop.is_set() and self._busy():
            wait = self._bucket.full_in()
            if wait <= 0:
                return
            self._stop.wait(min(wait, 0.05))

    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            self._stop.wait(seconds)

    def _count(self, **by: int) -> None:
        with self._mu:
            for key, n in by.items():
                self.counters[key] += n

    # ---- reports -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Progress of the pass under way, the last full pass, what the scrub found."""
        with self._mu:
            out: dict[str, Any] = {"rate": self.rate, "running": self._thread is not None
                                   and self._thread.is_alive(), **self.counters}
            if self._pass:
                out["pass"] = dict(self._pass)
            if self._last:
                out["last_pass"] = dict(self._last)
            if self._last_failure:
                out["last_failure"] = dict(self._last_failure)
            if self._resting_until is not None:
                out["resting_until"] = self._resting_until
        return out
