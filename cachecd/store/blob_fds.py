"""Open blob fds kept for warm hits: an LRU the daemon asks before it opens a blob.

Invariants: a kept fd is handed out (as a dup, the caller's own) only while the store still
indexes the very row it was opened under and the file is still linked with that row's size;
anything else (evicted, quarantined, deleted, truncated, replaced) falls back to
``Store.open_blob``. An idle daemon holds no blob open.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from cachecd import constants

if TYPE_CHECKING:
    from cachecd.store.index import Entry
    from cachecd.store.store import Store


class BlobFds:
    """An LRU of open blob fds, so a warm hit costs an fstat and a dup instead of an open.

    A cached fd is handed out (as a dup) only while the store's row for the digest is the very
    row the fd was opened under and the file is still linked with that row's size: an evicted,
    quarantined, deleted, truncated or replaced blob falls back to ``Store.open_blob``. Stale fds
    are closed at the next request after an eviction or quarantine and by a sweep every
    ``BLOB_FDS_SWEEP_S``; all are closed once no hit used the cache for ``BLOB_FDS_IDLE_S``, so an
    idle daemon holds no blob open and an evicted blob's disk space comes back promptly.
    Used on the event loop thread only.
    """

    def __init__(self, store: Store, capacity: int = constants.BLOB_FDS) -> None:
        self._store = store
        self._capacity = capacity
        self._fds: OrderedDict[str, tuple[Entry, int]] = OrderedDict()
        self._last_use = 0.0
        self._removals = -1
        self._timer: asyncio.TimerHandle | None = None

    def __contains__(self, digest: str) -> bool:
        return digest in self._fds

    def __len__(self) -> int:
        return len(self._fds)

    def take(self, digest: str) -> tuple[int, int] | None:
        """(fd, size) of a still-valid cached blob, the fd the caller's own; None to open it."""
        held = self._fds.get(digest)
        if held is None:
            return None
        entry, fd = held
        try:
            if self._store.entry(digest) is entry:
                st = os.fstat(fd)
                if st.st_nlink and st.st_size == entry.size:
                    mine = os.dup(fd)
                    self._fds.move_to_end(digest)
                    self._last_use = time.monotonic()
                    return mine, entry.size
        except OSError:  # EMFILE: our own fds are the ones to give back
            self.clear()
            return None
        self._close(digest)
        return None

    def keep(self, digest: str, fd: int, size: int) -> None:
        """Remember a dup of ``fd``, freshly opened by ``Store.open_blob`` for ``digest``."""
        entry = self._store.entry(digest)
        if self._capacity <= 0 or entry is None or entry.size != size or digest in self._fds:
            return
        try:
            self._fds[digest] = (entry, os.dup(fd))
        except OSError:
            self.clear()
            return
        self._last_use = time.monotonic()
        while len(self._fds) > self._capacity:
            self._close(next(iter(self._fds)))
        if self._timer is None:
            self._arm()

    def check(self) -> None:
        """Close the fds of blobs evicted or quarantined since the last look (cheap when none)."""
        removals = self._store.removals()
        if removals != self._removals:
            self._removals = removals
            self.sweep()

    def sweep(self) -> None:
        row = self._store.entry
        for digest in [d for d, (entry, _) in self._fds.items() if row(d) is not entry]:
            self._close(digest)

    def clear(self) -> None:
        for digest in list(self._fds):
            self._close(digest)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _close(self, digest: str) -> None:
        _, fd = self._fds.pop(digest)
        os.close(fd)

    def _arm(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(constants.BLOB_FDS_SWEEP_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if time.monotonic() - self._last_use >= constants.BLOB_FDS_IDLE_S:
            self.clear()
        else:
            self.sweep()
        if self._fds:
            self._arm()
