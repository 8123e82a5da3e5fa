"""How much memory the pool of expert slots takes by default, and when to resize it.

The pool is a setting (``cachecd run --ram``, ``load(..., ram_bytes=)``); by default it follows the
machine, measured when the resident model is loaded and again while it runs: the memory
available then, less a reserve left to the page cache and the rest of the system. What the
machine is and what is available are measured where the limit really is (``machine``): a
container's cgroup limit, a Mac's memory less what other processes hold, a GPU's free memory. A bigger pool
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

from cachecd_engine.pool import machine

GIB = 1 << 30
RESERVE_SHARE = 0.25  # of the machine's memory left to the page cache and the system
MIN_RESERVE = 2 * GIB
POOL_CAP_SHARE = 0.5  # the default pool never takes more of the machine's memory than this
GPU_RESERVE_SHARE = 0.1  # of a discrete GPU's memory left free: the KV cache grows, activations
GPU_MIN_RESERVE = 2 * GIB  # come and go between two measurements
GPU_CAP_SHARE = 0.5  # with no measurement of what is free, at most this much of the GPU
RESIZE_EVERY_S = 15.0  # how often a default-sized pool is measured again
RESIZE_STEP = 0.125  # a change smaller than this share of the pool is not worth a copy


def physical_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def machine_memory() -> int:
    """The machine's size for the pool: physical memory, or a cgroup's smaller limit."""
    total = physical_memory()
    if sys.platform.startswith("linux"):
        cgroup = machine.cgroup_memory()
        if cgroup is not None:
            return min(total, cgroup.limit)
    return total


def available_memory() -> int:
    """Bytes this process could still use: on Linux MemAvailable, or what its cgroup leaves if
    less; on macOS what other processes' memory leaves (``machine.vm_stat_available``); else
    physical memory less what MLX holds (the resident model)."""
    if sys.platform.startswith("linux"):
        free = _meminfo_available()
        cgroup = machine.cgroup_memory()
        if cgroup is not None:
            free = cgroup.available if free is None else min(free, cgroup.available)
        if free is not None:
            return free
    if sys.platform == "darwin":
        free = machine.darwin_available(physical_memory())
        if free is not None:
            return free
    return max(0, physical_memory() - mx.get_active_memory())


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gpu_memory() -> int | None:
    """A discrete GPU's memory, where MLX reports one (CUDA); None elsewhere (Metal shares
    physical memory)."""
    if mx.default_device().type != mx.DeviceType.gpu or mx.metal.is_available():
        return None
    size = mx.device_info().get("total_memory") or mx.device_info().get("memory_size")
    return int(size) if size else None


def gpu_available() -> int | None:
    """A discrete GPU's memory free now (``machine.gpu_free``); None elsewhere."""
    return machine.gpu_free()


def pool_bytes_for(total: int, available: int, current: int = 0,
                   gpu_total: int | None = None, gpu_free: int | None = None) -> int:
    """The pool's size for a machine of ``total`` bytes of memory with ``available`` left (and a
    discrete GPU of ``gpu_total`` with ``gpu_free`` free): what the pool holds (``current``)
    plus what is available beyond the reserve (less, if the reserve is eaten into), within the
    caps. On a GPU the same rule applies to its free memory, which counts the resident model,
    the KV cache and the pool itself as taken; without a measurement of it, half the card. The
    one model of the default: the engine applies it to what it measures, ``cachecd plan`` to
    the doctor's figures."""
    reserve = max(MIN_RESERVE, int(total * RESERVE_SHARE))
    want = current + available - reserve
    caps = [int(total * POOL_CAP_SHARE)]
    if gpu_total is not None and gpu_free is not None:
        caps.append(current + gpu_free - max(GPU_MIN_RESERVE, int(gpu_total * GPU_RESERVE_SHARE)))
    elif gpu_total is not None:
        caps.append(int(gpu_total * GPU_CAP_SHARE))
    return max(0, min(want, *caps))


def default_pool_bytes(current: int = 0) -> int:
    """The pool's size now, from this machine's memory measured now (``pool_bytes_for``)."""
    return pool_bytes_for(machine_memory(), available_memory(), current, gpu_memory(),
                          gpu_available())


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
