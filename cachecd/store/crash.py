"""Named crash points for the kill -9 test matrix (RELIABILITY.md scenario 1).

``crash_point(name)`` SIGKILLs the process when ``constants.CRASH_AT`` equals ``name``. The
variable is read once at import (``CACHECD_CRASH_AT``), so a test sets it in a child process's
environment. SIGKILL, not an exception: nothing may clean up, exactly like a power cut of the
process (the kernel still has the page cache, so this is not a power-loss test).

``CACHECD_PAUSE_AT=POINT:SECONDS`` sleeps at that point instead: a test can hold the write path
there to observe what happens meanwhile (an answer before the blob is durable, say).

Points on the blob write path, in order: after_tmp_write, after_fsync, after_rename,
before_index_commit, after_index_commit. In the index: during_map_growth (the LMDB map was just
grown, the write txn that ran out of room not yet retried). At start: during_recovery (the
repair done, neither socket bound yet).
"""

from __future__ import annotations

import os
import signal
import time

from cachecd import constants

WRITE_PATH_POINTS: tuple[str, ...] = (
    "after_tmp_write",
    "after_fsync",
    "after_rename",
    "before_index_commit",
    "after_index_commit",
)


def crash_point(name: str) -> None:
    if constants.CRASH_AT is not None and constants.CRASH_AT == name:
        os.kill(os.getpid(), signal.SIGKILL)
    if constants.PAUSE_AT is not None:
        point, _, seconds = constants.PAUSE_AT.partition(":")
        if point == name:
            time.sleep(float(seconds or 1))
