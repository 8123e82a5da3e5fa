"""quarantine/: blobs that failed verification, never served, the newest few kept for a look.

Invariants: a file enters only by rename (from blobs/ or tmp/), so nothing is copied; at most
``constants.QUARANTINE_KEEP`` files stay per cache dir (older ones are deleted as a new one comes
in, and at start), so a disk that keeps rotting cannot fill up with them; ``nbytes`` is what they
hold, which the store counts against the budget.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from cachecd import constants

log = logging.getLogger(__name__)


class Quarantine:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._mu = threading.Lock()  # the scrub's thread and the event loop both quarantine
        self._files = self._scan()  # (path, size), oldest first
        with self._mu:
            self._prune()

    def add(self, path: Path, reason: str) -> Path | None:
        """Move ``path`` in; None if it is gone already."""
        dest = self.root / f"{path.name}.{time.time_ns()}"
        with self._mu:
            try:
                os.rename(path, dest)
                size = os.stat(dest, follow_symlinks=False).st_size
            except FileNotFoundError:
                return None
            self._files.append((str(dest), size))
            self._prune()
        log.warning("event=quarantined path=%s dest=%s reason=%s", path, dest, reason)
        return dest

    def nbytes(self) -> int:
        with self._mu:
            return sum(size for _, size in self._files)

    def __len__(self) -> int:
        with self._mu:
            return len(self._files)

    def _scan(self) -> list[tuple[str, int]]:
        found = []
        for ent in os.scandir(self.root):
            try:
                st = ent.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if ent.is_dir(follow_symlinks=False):
                continue  # not ours (put there by hand): neither counted nor deleted
            found.append((st.st_mtime_ns, ent.path, st.st_size))
        return [(path, size) for _, path, size in sorted(found)]

    def _prune(self) -> None:
        while len(self._files) > constants.QUARANTINE_KEEP:
            path, _ = self._files.pop(0)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            log.info("event=quarantine_pruned path=%s", path)
