"""How fast a cache dir reads expert-sized blocks: cold (the page cache bypassed) at queue
depths 1-32, and from the page cache.

Invariants: the probe reads and writes only its own temp file in the dir, removed at the end
(also on an error or Ctrl-C). Cold reads bypass the page cache with ``O_DIRECT`` on Linux
(``posix_fadvise(DONTNEED)`` before each pass where the file system refuses it) and
``F_NOCACHE`` on macOS; ``method`` says which one was used, and ``bypassed`` is False where
nothing could (tmpfs: the page cache is the storage).
"""

from __future__ import annotations

import itertools
import mmap
import os
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cachecd import constants
from cachecd.durable import full_fsync

QUEUE_DEPTHS = (1, 2, 4, 8, 16, 32)
K3_EXPERT_BYTES = constants.K3_EXPERT_BYTES  # one Kimi K3 expert, a multiple of 4096
ALIGN = 4096  # O_DIRECT wants offsets, sizes and buffers aligned to the logical block
PAGE_CACHE_READERS = 4  # the client's parallel readers (cachecd_client.Client's default)
F_NOCACHE = 48  # <sys/fcntl.h> on macOS; Python's fcntl module lacks the name


@dataclass
class DiskFigures:
    path: str
    method: str  # how the page cache was bypassed
    bypassed: bool
    block_bytes: int
    file_bytes: int
    free_bytes: int
    cold: dict[int, float] = field(default_factory=dict)  # queue depth -> bytes/s
    page_cache: float = 0.0  # bytes/s at PAGE_CACHE_READERS

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["cold"] = {str(k): v for k, v in self.cold.items()}
        return out


def probe_dir(path: str | Path, size: int, block: int = K3_EXPERT_BYTES,
              depths: tuple[int, ...] = QUEUE_DEPTHS) -> DiskFigures:
    """Measure ``path`` with a temp file of ``size`` bytes (rounded to whole blocks)."""
    path = Path(path)
    made = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    block = -(-block // ALIGN) * ALIGN  # a read of a part of a page reads the whole page
    n = max(1, size // block)
    fd, tmp = tempfile.mkstemp(prefix=".cachecd-doctor-", dir=path)
    try:
        _write(fd, n, block)
        method, bypassed = _bypass_method(tmp, path)
        figs = DiskFigures(str(path), method, bypassed, block, n * block,
                           shutil.disk_usage(path).free)
        for qd in depths:
            figs.cold[qd] = _cold_rate(tmp, n, block, qd, method)
        figs.page_cache = _page_cache_rate(tmp, n, block)
        return figs
    finally:
        os.close(fd)
        os.unlink(tmp)
        if made:
            path.rmdir()


def _write(fd: int, n: int, block: int) -> None:
    data = os.urandom(1 << 20) * (block >> 20) + os.urandom(block % (1 << 20))
    for _ in range(n):
        os.write(fd, data)
    full_fsync(fd)  # dirty pages cannot be dropped; written ones can


def _bypass_method(tmp: str, path: Path) -> tuple[str, bool]:
    if sys.platform == "darwin":
        return "F_NOCACHE", True
    if _is_tmpfs(path):
        return "none (tmpfs: the page cache is the storage)", False
    try:
        os.close(os.open(tmp, os.O_RDONLY | os.O_DIRECT))
        return "O_DIRECT", True
    except OSError:
        return "posix_fadvise(DONTNEED)", True


def _is_tmpfs(path: Path) -> bool:
    """Whether ``path`` is on tmpfs or ramfs (Linux: the longest mount point above it)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    real, best, kind = str(path.resolve()), "", ""
    for line in mounts:
        parts = line.split()
        if len(parts) > 2 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind in ("tmpfs", "ramfs")


def _open_cold(tmp: str, method: str) -> int:
    if method == "O_DIRECT":
        return os.open(tmp, os.O_RDONLY | os.O_DIRECT)
    fd = os.open(tmp, os.O_RDONLY)
    if method == "F_NOCACHE":
        import fcntl

        fcntl.fcntl(fd, F_NOCACHE, 1)
    elif hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return fd


def _cold_rate(tmp: str, n: int, block: int, qd: int, method: str) -> float:
    fd = _open_cold(tmp, method)
    try:
        return _read_all(fd, n, block, qd)
    finally:
        os.close(fd)


def _page_cache_rate(tmp: str, n: int, block: int) -> float:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        _read_all(fd, n, block, PAGE_CACHE_READERS)  # brings it in
        return max(_read_all(fd, n, block, PAGE_CACHE_READERS) for _ in range(2))
    finally:
        os.close(fd)


def _read_all(fd: int, n: int, block: int, qd: int) -> float:
    """Bytes/s reading every block of ``fd`` with ``qd`` reads in flight: ``qd`` workers, each
    with its own page-aligned buffer (as O_DIRECT wants), written once before the clock starts
    (no page faults timed), taking the next block as one lands. Blocks are read in a random
    order, as experts are (each its own blob file): a sequential pass would be helped by the
    device's read-ahead."""
    workers = min(qd, n)
    bufs = [mmap.mmap(-1, block) for _ in range(workers)]
    for buf in bufs:
        buf.write(bytes(block))
    order = random.Random(n).sample(range(n), n)
    blocks = itertools.count()

    def worker(buf: mmap.mmap) -> int:
        got = 0
        while (i := next(blocks)) < n:  # next() on a count is atomic under the GIL
            got += os.preadv(fd, [buf], order[i] * block)
        return got

    try:
        with ThreadPoolExecutor(workers) as pool:
            t0 = time.perf_counter()
            got = sum(pool.map(worker, bufs))
            dt = time.perf_counter() - t0
    finally:
        for buf in bufs:
            buf.close()
    return got / dt if dt > 0 else 0.0
