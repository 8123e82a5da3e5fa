"""What the machine has left for the pool, measured where the limit really is.

- Linux: a cgroup's memory limit is the machine's size when it is smaller than physical memory
  (a container sees the host's RAM in /proc/meminfo, but is killed at its cgroup's limit). The
  limit and usage are read from the process's own cgroup (``/proc/self/cgroup``) and every
  cgroup above it; the tightest headroom wins. The page cache the cgroup holds and could drop
  (inactive file pages) counts as free, as MemAvailable counts it.
- macOS: other processes' memory counts. ``vm_stat``'s free, file-backed (the page cache,
  dropped before anything is compressed or swapped) and purgeable pages are available;
  wired, compressed and anonymous memory (other processes' and this one's, the resident model
  included) are not. A pool larger than that makes macOS compress and page.
- CUDA: the GPU's free memory now (after the resident model, the KV cache and the pool
  itself), as MLX reports it, or ``cudaMemGetInfo``; MLX's own buffer cache counts as free.

Every function returns None where it cannot measure; the caller then falls back to what it knew.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge page-rounded number


@dataclass(frozen=True)
class CgroupMemory:
    limit: int  # bytes the tightest cgroup on the way to the root may hold
    available: int  # what is left under that limit (its droppable page cache counted as free)


def cgroup_memory(root: Path | None = None, proc: Path | None = None) -> CgroupMemory | None:
    """The memory limit of this process's cgroup (v1's memory controller, else v2) and what is
    left under it; None where no cgroup limits memory or nothing can be read. ``root`` is where
    the cgroup filesystem is mounted, ``proc`` the process's ``/proc/self/cgroup``."""
    root, proc = root or CGROUP_ROOT, proc or PROC_CGROUP
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    if v1 is not None:  # a hybrid host mounts v2 too, without the memory controller
        return _tightest(root / "memory", v1, "memory.limit_in_bytes", "memory.usage_in_bytes",
                         "total_inactive_file")
    if v2 is not None:
        return _tightest(root, v2, "memory.max", "memory.current", "inactive_file")
    return None


def _tightest(mount: Path, path: str, limit_file: str, usage_file: str,
              inactive: str) -> CgroupMemory | None:
    """The cgroup at ``path`` under ``mount`` and each one above it: the least headroom. A path
    the mount does not show (a container's namespace shows its own cgroup as the root) is read
    from the mount's root."""
    leaf = mount / path.lstrip("/")
    if not leaf.is_dir():
        leaf = mount
    best: CgroupMemory | None = None
    for d in [leaf, *leaf.parents]:
        if not d.is_relative_to(mount):
            break
        limit = _read_int(d / limit_file)
        usage = _read_int(d / usage_file)
        if limit is None or limit >= NO_LIMIT or usage is None:
            continue
        used = usage - (_stat(d / "memory.stat", inactive) or 0)
        here = CgroupMemory(limit, max(0, limit - used))
        if best is None or here.available < best.available:
            best = here
    return best


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2's "max": no limit


def _stat(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return None


def vm_stat_available(text: str, total: int) -> int | None:
    """Bytes a machine of ``total`` bytes could give the pool without paging, from ``vm_stat``'s
    output: free, file-backed and purgeable pages (speculative pages are file-backed ones read
    ahead: counted there), and never more than what wired, compressed and non-purgeable
    anonymous memory leave. None if the text is not ``vm_stat``'s."""
    size = re.search(r"page size of (\d+) bytes", text)
    pages = {k.strip().strip('"'): int(v) for k, v in re.findall(r"^(.+?):\s+(\d+)\.?$", text,
                                                                  re.MULTILINE)}
    want = ("Pages free", "File-backed pages", "Pages purgeable",
            "Pages wired down", "Pages occupied by compressor", "Anonymous pages")
    if size is None or any(k not in pages for k in want):
        return None
    page = int(size.group(1))
    purgeable = pages["Pages purgeable"]
    droppable = (pages["Pages free"] + pages["File-backed pages"] + purgeable) * page
    held = (pages["Pages wired down"] + pages["Pages occupied by compressor"]
            + max(0, pages["Anonymous pages"] - purgeable)) * page
    return max(0, min(droppable, total - held))


def darwin_available(total: int) -> int | None:
    """``vm_stat_available`` of this Mac now; None if ``vm_stat`` cannot be run."""
    try:
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return vm_stat_available(out, total)


def gpu_free() -> int | None:
    """A discrete GPU's free memory now plus MLX's cached buffers (free to MLX, held from the
    driver); None where MLX computes on no CUDA device or neither MLX nor the runtime says."""
    if mx.default_device().type != mx.DeviceType.gpu or mx.metal.is_available():
        return None
    free = mx.device_info().get("free_memory")  # newer MLX: NVML's, or cudaMemGetInfo
    if free is None:
        free = _cuda_mem_get_info()
    return None if free is None else int(free) + mx.get_cache_memory()


def _cuda_mem_get_info() -> int | None:
    from cachecd_engine.pool import cuda_memory

    lib = cuda_memory._runtime()
    if lib is None:
        return None
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    if lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
        return None
    return int(free.value)
