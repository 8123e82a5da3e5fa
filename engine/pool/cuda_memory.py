"""Misses into the pool on a discrete CUDA GPU: read into pinned host memory, then copied to the
slot by the GPU's copy engine.

MLX's CUDA arrays that the host can see are managed memory. A host write into a slot whose
pages a kernel has read (so they live on the GPU) first migrates those pages back to the host
and the next kernel faults them over again page by page: measured on the H200, a pool smaller
than the working set then ran 2.5 decode steps a second at K3's expert size, 0.45 with the
pool marked read-mostly and filled slots prefetched. So on CUDA a miss is read into a pinned
staging buffer (the one copy from the page cache), then ``cudaMemcpyAsync`` puts it in the slot
where the slot's pages are, and the host waits for those copies before the call is built. The
host never touches the pool's pages, which stay on the GPU.

The CUDA runtime is loaded by name (MLX links its own copy statically; both drive the same
device). Any failure (no CUDA 13 runtime, a call refused) turns the copier off and the bank
writes slots from the host as on unified memory; a bank on CUDA says so in one warning when it
starts (``event=cuda_copier_off``), not only when a call is refused.

Invariant: pinned staging is unregistered before its memory is freed, whether the bank is
closed, the staging grows, or the copier is dropped without a close (a bank let go of): the
unregistration holds the buffer until it has run. Freeing registered memory leaves the
driver's registration behind; a later buffer at those addresses then cannot be pinned, and a
copy from it reads the old pages.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

USE = True  # a switch for side-by-side measurement (bench/k3_decode.py's pc-hostwrite case)
_DEFAULT = 4  # cudaMemcpyDefault: the driver tells host from device by the pointers
_PER_THREAD_STREAM = ctypes.c_void_p(2)  # cudaStreamPerThread: waits for no other stream
RUNTIME_NAMES = ("libcudart.so.13", "libcudart.so")
_lib: Any = None
_tried = False
_OFF = ("event=cuda_copier_off %s; misses are written into the pool from the host, whose "
        "writes move the GPU's pages back and forth (several times slower with a pool smaller "
        "than the working set); install the CUDA 13 runtime (libcudart.so.13) to use the copy "
        "engine")


def _runtime() -> Any:
    """libcudart (13 or newer: the signatures below), or None."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    for name in RUNTIME_NAMES:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0 or version.value < 13000:
            log.warning(_OFF, f"runtime={name} version={version.value} (13000 or newer needed)")
            return None
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_int, ctypes.c_void_p]
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        _lib = lib
        return lib
    log.warning(_OFF, f"runtime=none (no {' or '.join(RUNTIME_NAMES)} could be loaded)")
    return None


class Copier:
    """Pinned staging memory and copies from it to the pool; ``on`` goes False at the first
    refused call (the caller then writes slots from the host)."""

    def __init__(self) -> None:
        self.on = USE and _runtime() is not None
        self._staging: np.ndarray | None = None
        self._unpin: weakref.finalize | None = None  # unregisters the staging (holds it till then)
        self.copied = 0  # bytes copied to the GPU
        # Copy each window of a miss as it lands (False: each expert once it is whole, the
        # engine before; bench/k3_decode.py's pc-expertcopy case measures the two side by side).
        self.by_window = True

    def staging(self, nbytes: int) -> np.ndarray:
        """A pinned, cache-line aligned host buffer of at least ``nbytes`` (grown as needed)."""
        if self._staging is None or self._staging.size < nbytes:
            self._release()
            raw = np.ones(nbytes + 64, np.uint8)  # touched: no page faults in a read
            off = -raw.ctypes.data % 64
            buf = raw[off : off + nbytes]
            err = _lib.cudaHostRegister(buf.ctypes.data, nbytes, 0) if self.on else -1
            if err == 0:
                self._unpin = weakref.finalize(self, _unregister, _lib, buf)
            elif self.on:  # 712: part of it is registered already (memory freed while pinned)
                log.warning("event=cuda_staging_unpinned err=%d bytes=%d: the copier's staging "
                            "could not be pinned; its copies are pageable (slower)", err, nbytes)
            self._staging = buf
        return self._staging

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        if self.on:
            self._check(_lib.cudaMemcpyAsync(dst, src, nbytes, _DEFAULT, _PER_THREAD_STREAM))
            self.copied += nbytes

    def wait(self) -> bool:
        """Wait for the copies; False if any failed (the caller writes from the host)."""
        if self.on:
            self._check(_lib.cudaStreamSynchronize(_PER_THREAD_STREAM))
        return self.on

    def _check(self, err: int) -> None:
        if err != 0:
            log.warning("cuda copier off: a CUDA call returned %d; slots are written from the "
                        "host from now on", err)
            self.on = False

    def close(self) -> None:
        """Release the pinned staging (the bank is closed; a later miss would pin anew)."""
        self._release()

    def _release(self) -> None:
        if self._unpin is not None:
            self._unpin()  # runs once: unregistered, then the buffer may go
        self._staging, self._unpin = None, None


def _unregister(lib: Any, buf: np.ndarray) -> None:
    """Unpin ``buf`` (it is alive: the finalizer holding this call holds it)."""
    lib.cudaHostUnregister(buf.ctypes.data)
