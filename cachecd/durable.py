"""Durable writes: the one place that decides which call makes written bytes survive a power loss.

On Linux, fsync(2) returns once the file's data and metadata are on the device and the device's
volatile write cache has been flushed. On macOS it does not: fsync(2) hands the data to the
drive, and "the drive itself may not physically write the data to the platters for quite some
time and it may be written in an out-of-order sequence" (fsync(2) in xnu). ``fcntl(fd,
F_FULLFSYNC)`` "does the same thing as fsync(2) then asks the drive to flush all buffered data
to the permanent storage device" (fcntl(2)); SQLite and LMDB use it there, and so does cachecd.

Invariants:
- Every durability point of cachecd (a blob's temp file and its directory, the resident model
  file, a manifest and its directory, a service unit file) goes through ``full_fsync`` or
  ``sync_dir``; nothing else in cachecd/, client/ or engine/ calls ``os.fsync``
  (tests/unit/test_durable.py walks the source for it).
- On Darwin, a file system that does not implement F_FULLFSYNC gets fsync(2) instead, as SQLite,
  libuv and Go do, with one warning per process and errno; any other error of either call is
  raised, because it means the bytes may not be on disk.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# How F_FULLFSYNC says "not implemented here" rather than "the sync failed". xnu hands the fcntl
# to the file system as an ioctl (bsd/kern/kern_descrip.c), so the errno is the file system's
# answer to an ioctl it does not know: ENOTSUP from the VFS default (err_ioctl in
# bsd/vfs/vfs_support.c; SMB shares answer it, golang/go#64215), ENOTTY where an ioctl switch
# ends in it (a raw device, libuv#1579), EINVAL where it calls an unknown request invalid. Falling
# back on EINVAL hides nothing: fsync(2) then raises if the file cannot be synced at all. EIO,
# ENOSPC, EDQUOT, EROFS and EBADF are failures of the sync itself and are raised (an fsync after
# EIO could report success for pages the kernel already dropped).
REFUSED = frozenset({errno.ENOTSUP, errno.ENOTTY, errno.EINVAL})
_warned: set[int] = set()


def full_fsync(fd: int, *, platform: str | None = None) -> str:
    """Make what was written to ``fd`` durable; returns the call that did it.

    "F_FULLFSYNC" on Darwin, "fsync" elsewhere and where a Darwin file system refuses
    F_FULLFSYNC. ``platform`` is ``sys.platform`` unless given (tests give it).
    """
    if (platform or sys.platform) == "darwin":
        try:
            fcntl.fcntl(fd, _f_fullfsync())
            return "F_FULLFSYNC"
        except OSError as exc:
            if exc.errno not in REFUSED:
                raise
            _warn_refused(exc)
    os.fsync(fd)
    return "fsync"


def sync_dir(path: Path, *, platform: str | None = None) -> str:
    """Make the entries of directory ``path`` durable (after a rename into it, a new file)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return full_fsync(fd, platform=platform)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` so that a crash or power loss leaves the old file or the new
    one, never a mix: a temp file beside it, synced, renamed over it, the directory synced.
    ``mode`` sets the new file's permission bits (mkstemp's 0600 otherwise)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            full_fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    sync_dir(path.parent)


def _f_fullfsync() -> int:
    # CPython's fcntl module defines F_FULLFSYNC only where <fcntl.h> does (macOS): looked up
    # by name, never hard-coded, so no other system ever gets a command number meant for Darwin.
    cmd = getattr(fcntl, "F_FULLFSYNC", None)
    if cmd is None:
        raise OSError(errno.ENOTSUP, "this Python's fcntl module has no F_FULLFSYNC")
    return int(cmd)


def _warn_refused(exc: OSError) -> None:
    if exc.errno in _warned:
        return
    _warned.add(exc.errno or 0)
    log.warning(
        "event=full_fsync_refused errno=%s err=%s fallback=fsync: this file system does not "
        "implement F_FULLFSYNC, so a power loss can lose writes the drive still caches; keep "
        "cache dirs on APFS or HFS+",
        errno.errorcode.get(exc.errno or 0, exc.errno), exc.strerror,
    )
