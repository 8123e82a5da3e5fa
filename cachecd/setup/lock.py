"""One setup of a model at a time, and one daemon started for a socket at a time.

Two ``cachecd setup --stream`` of one model at once would write the same resident file, its
progress record and the same manifest build's parts; with no daemon running each would start
one, and the second would die on the cache's lock (``cache_locked``). So:

- ``model_lock``: an exclusive ``flock`` on ``MODELS_DIR/.locks/ORG--NAME.lock``, held for the
  whole setup. A second setup says "another setup is installing ORG/NAME (pid N)" and waits for
  it; it then finds everything installed (setup resumes) and the daemon the first started.
- ``start_lock``: the same beside the daemon's log, held while a setup asks for a daemon on the
  socket and starts one, so setups of two models find each other's daemon.

The kernel drops a ``flock`` when its holder exits, however it exits: a killed setup leaves
nothing to clean up. The pid in the file is only for the message.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def model_lock(models_dir: Path, repo: str) -> Iterator[None]:
    path = models_dir / ".locks" / f"{repo.replace('/', '--')}.lock"
    with held(path, f"another setup is installing {repo}"):
        yield


@contextmanager
def held(path: Path, who: str) -> Iterator[None]:
    """``path`` locked exclusively; if another process holds it, ``who`` (pid N) is printed and
    its end waited for."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            print(f"{who} (pid {pid}): waiting for it to finish", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # drops the lock
