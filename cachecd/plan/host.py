"""The machine's memory, swap and MLX device, as the doctor reports them.

Memory is measured by the engine's own functions (``cachecd_engine.pool.memory``), so a plan built
from these figures sizes the pool exactly as the engine would on this machine.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any


def memory_figures() -> dict[str, Any]:
    from cachecd_engine.pool import memory

    # total: a container's cgroup limit where it is less than physical memory
    total, available = memory.machine_memory(), memory.available_memory()
    gpu, gpu_free = memory.gpu_memory(), memory.gpu_available()
    swap_total, swap_used = swap()
    return {"total_bytes": total, "available_bytes": available, "swap_total_bytes": swap_total,
            "swap_used_bytes": swap_used, "gpu_bytes": gpu, "gpu_free_bytes": gpu_free,
            "default_pool_bytes": memory.pool_bytes_for(total, available, 0, gpu, gpu_free)}


def swap() -> tuple[int | None, int | None]:
    """(total, used) bytes of swap; None where it cannot be read."""
    if sys.platform.startswith("linux"):
        try:
            info = {k: int(v.split()[0]) * 1024 for k, v in
                    (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines()
                     if ":" in line) if v.split()}
            return info["SwapTotal"], info["SwapTotal"] - info["SwapFree"]
        except (OSError, KeyError, ValueError):
            return None, None
    if sys.platform == "darwin":  # "total = 2048.00M  used = 1054.25M  free = 993.75M ..."
        try:
            out = subprocess.run(["sysctl", "-n", "vm.swapusage"], capture_output=True,
                                 text=True, timeout=5).stdout
            sizes = dict(re.findall(r"(\w+) = ([\d.]+)M", out))
            return int(float(sizes["total"]) * 2**20), int(float(sizes["used"]) * 2**20)
        except (OSError, KeyError, ValueError, subprocess.SubprocessError):
            return None, None
    return None, None


def mlx_figures() -> dict[str, Any]:
    """MLX's version, backend and default device, as MLX reports them."""
    try:
        import mlx.core as mx
    except ImportError as exc:
        return {"error": f"mlx does not import: {exc}"}
    backend = ("metal" if mx.metal.is_available() else
               "cuda" if _cuda_available(mx) else "cpu")
    info: dict[str, Any] = {}
    try:
        info = {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
    except Exception:  # noqa: BLE001 - a backend without device_info is still reported
        pass
    return {"version": mx.__version__,  # type: ignore[attr-defined]
            "backend": backend, "device": str(mx.default_device()),
            "device_info": info}


def _cuda_available(mx: Any) -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and getattr(cuda, "is_available", lambda: False)())
