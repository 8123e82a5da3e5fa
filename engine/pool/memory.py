"""How much memory the pool of expert slots takes by default, and when to resize it.

The pool is a setting (``cachecd run --ram``, ``load(..., ram_bytes=)``); by default it follows the
machine, measured when the resident model is loaded and again while it runs: the memory
available then, less a reserve left to the page cache and the rest of the system. A bigger pool
is not always faster: the daemon's blobs are read through the page cache, and on Apple silicon
a cache that starves it was measured slower (8 GB beat 32 GB in one published report, 35 GB
beat 60 GB in another), so the reserve is a share of physical memory, not a few hundred MB.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import mlx.core as mx

GIB = 1 << 30
RESERVE_SHARE = 0.25  # of physical memory left to the page cache and the system
MIN_RESERVE = 2 * GIB
POOL_CAP_SHARE = 0.5  # the default pool never takes more of physical memory than this
GPU_CAP_SHARE = 0.5  # nor more of a discrete GPU's memory (MLX's CUDA pool is managed memory)
RESIZE_EVERY_S = 15.0  # how often a default-sized pool is measured again
RESIZE_STEP = 0.125  # a change smaller than this share of the pool is not worth a copy


def physical_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory() -> int:
    """Bytes this process could still use: MemAvailable on Linux, else physical memory less
    what MLX holds (the resident model)."""
    if sys.platform.startswith("linux"):
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
    return max(0, physical_memory() - mx.get_active_memory())


def gpu_memory() -> int | None:
    """A discrete GPU's memory, where MLX reports one (CUDA); None elsewhere (Metal shares
    physical memory)."""
    if mx.default_device().type != mx.DeviceType.gpu or mx.metal.is_available():
        return None
    size = mx.device_info().get("total_memory") or mx.device_info().get("memory_size")
    return int(size) if size else None


def pool_bytes_for(total: int, available: int, current: int = 0,
                   gpu_total: int | None = None) -> int:
    """The pool's size for a machine of ``total`` bytes of memory with ``available`` left (and a
    discrete GPU of ``gpu_total``): what the pool holds (``current``) plus what is available
    beyond the reserve (less, if the reserve is eaten into), within the caps. The one model of
    the default: the engine applies it to what it measures, ``cachecd plan`` to the doctor's
    figures."""
    reserve = max(MIN_RESERVE, int(total * RESERVE_SHARE))
    want = current + available - reserve
    caps = [int(total * POOL_CAP_SHARE)]
    if gpu_total is not None:
        caps.append(int(gpu_total * GPU_CAP_SHARE))
    return max(0, min(want, *caps))


def default_pool_bytes(current: int = 0) -> int:
    """The pool's size now, from this machine's memory measured now (``pool_bytes_for``)."""
    return pool_bytes_for(physical_memory(), available_memory(), current, gpu_memory())


class PoolSizer:
    """Measures again every ``RESIZE_EVERY_S`` seconds and says when a default-sized pool
    should change (by more than ``RESIZE_STEP`` of its size)."""

    def __init__(self, every_s: float = RESIZE_EVERY_S) -> None:
        self.every_s = every_s
        self._next = time.monotonic() + every_s

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def target(self, current: int) -> int | None:
        self._next = time.monotonic() + self.every_s
        want = default_pool_bytes(current)
        if abs(want - current) <= RESIZE_STEP * current:
            return None
        return want
