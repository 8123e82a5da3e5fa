"""The first run on a fresh machine: MLX's CPU backend compiles each fused kernel the first time
a process on the machine needs it (a C++ compiler run per kernel, kept under the temp dir as
``mlx/<version>/cpu/*.so``), so the first layers of the first run wait on compilers, not on
experts: tens of seconds on the tiny model, 54 s seen on layer 1 of a small machine.

``compiling_notice`` says so once, before the first forward pass, where that cache holds no
compiled kernel yet; progress lines then give no time estimate from those layers
(``prefill_progress``). Metal and CUDA ship or cache their kernels otherwise: no notice there.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

COMPILING = ("compiling kernels (once per machine): MLX builds its CPU kernels while the first "
             "layers run, so they are slow this time only")


def kernel_cache() -> Path:
    """Where MLX keeps the CPU kernels it compiled: its temp dir (``TMPDIR``, as C++'s
    ``temp_directory_path``) / mlx / version / cpu."""
    import mlx.core as mx

    return Path(tempfile.gettempdir()) / "mlx" / str(mx.__version__) / "cpu"  # type: ignore[attr-defined]


def compiles_kernels() -> bool:
    """Whether this run will compile MLX's CPU kernels: the CPU is the device and the cache
    holds none yet."""
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.cpu:
        return False
    cache = kernel_cache()
    return not (cache.is_dir() and any(cache.glob("*.so")))


def compiling_notice() -> str | None:
    """``COMPILING`` where this run will compile the kernels, else None."""
    return COMPILING if compiles_kernels() else None
