"""How much memory the engine's expert buffers and RAM tier take by default.

Both are settings (``cachecd run --expert-memory/--ram``, ``load(..., expert_memory=, ram_bytes=)``);
the defaults follow the machine: the RAM tier takes a share of the memory left once the resident
model is loaded, the stack buffers a fixed bound (a long prefill that routes to every expert of
a layer runs in groups within it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import mlx.core as mx

GIB = 1 << 30
DEFAULT_EXPERT_MEMORY = 4 * GIB  # both stack buffers together; 122 K3 experts each
RAM_TIER_SHARE = 0.25  # of the memory available after the resident model is loaded


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
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(0, total - mx.get_active_memory())


def default_expert_memory() -> int:
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(DEFAULT_EXPERT_MEMORY, total // 8)


def default_ram_tier() -> int:
    """The RAM tier's budget when none is given: a share of what is available now."""
    return int(available_memory() * RAM_TIER_SHARE)
