"""Hints to the CUDA driver about the pool's managed memory (MLX's CUDA buffers that the host
writes are managed memory): a hint only, never needed for a right result.

Left alone, a page of the pool lives on the GPU once a kernel has read it; when a miss is read
into its slot the host's write first migrates the page's old bytes back to the host, and the
next kernel faults the new bytes over page by page. Two hints avoid both:
- ``read_mostly``: the pool is marked read-mostly, so the GPU reads a copy of each page and a
  host write only drops that copy (no migration back);
- ``to_device``: after a slot is filled, its bytes are prefetched to the GPU in bulk, on the
  calling thread's default stream (which does not wait for MLX's streams), ahead of the kernel.

The CUDA runtime is loaded by name (MLX links its own copy statically; both drive the same
device context). Any failure (no CUDA, another version, a call refused) turns the hints off.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

log = logging.getLogger(__name__)

_READ_MOSTLY = 1  # cudaMemAdviseSetReadMostly
_DEVICE = 1  # cudaMemLocationTypeDevice
_PER_THREAD_STREAM = ctypes.c_void_p(2)  # cudaStreamPerThread


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


USE = True  # a switch for side-by-side measurement (bench/k3_decode.py's pc-nohint case)
_lib: Any = None
_tried = False


def _runtime() -> Any:
    """libcudart with the CUDA 13 signatures of the two calls, or None."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    for name in ("libcudart.so.13", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0 or version.value < 13000:
            log.debug("cuda hints off: runtime %s version=%d", name, version.value)
            return None
        lib.cudaMemAdvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, _Location]
        lib.cudaMemPrefetchAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, _Location,
                                             ctypes.c_uint, ctypes.c_void_p]
        _lib = lib
        return lib
    return None


class Hints:
    """The hints for one device; ``on`` goes False at the first refused call."""

    def __init__(self, device: int = 0) -> None:
        self.on = USE and _runtime() is not None
        self._where = _Location(_DEVICE, device)

    def read_mostly(self, addr: int, nbytes: int) -> None:
        if self.on:
            self._check(_lib.cudaMemAdvise(addr, nbytes, _READ_MOSTLY, self._where), "advise")

    def to_device(self, addr: int, nbytes: int) -> None:
        if self.on:
            self._check(_lib.cudaMemPrefetchAsync(addr, nbytes, self._where, 0,
                                                  _PER_THREAD_STREAM), "prefetch")

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            log.debug("cuda hints off: %s returned %d", what, err)
            self.on = False
