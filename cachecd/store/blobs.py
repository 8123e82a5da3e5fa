"""Blob files: content-addressed expert bytes on one or more cache dirs (one per SSD).

Layout of each cache dir::

    lock              flock(LOCK_EX|LOCK_NB) held for the owner's lifetime; holds the owner's pid
    blobs/XX/DIGEST   the bytes whose xxh3-128 hex digest is DIGEST (XX = its first two chars)
    tmp/              writes in progress; anything here at start is a leftover and is removed
    quarantine/       files that failed verification, never served; the newest
                      ``constants.QUARANTINE_KEEP`` are kept for inspection, older ones deleted

Invariants:
- A path is only ever built from a validated digest (exactly 32 lowercase hex chars); anything
  else raises ``InvalidRequest`` before any I/O.
- A file appears under blobs/ only by rename from tmp/ after all its bytes were written and
  made durable (``cachecd.durable.full_fsync``: F_FULLFSYNC on macOS, fsync elsewhere); the
  directory is synced the same way after the rename. The caller commits the index row after
  ``write_blob`` returns, so there is never a row without a complete, durable blob.
- Every open uses O_NOFOLLOW (a planted symlink is refused) and O_CLOEXEC; temp files are created
  with O_EXCL, mode 0600.
- ENOSPC/EDQUOT anywhere on the write path removes the temp and raises ``DiskFull``.
- Unlinking a blob never disturbs a reader that already holds an fd: the kernel keeps the inode
  until the last fd closes. Eviction relies on this instead of reader refcounts.
- A fan-out dir (blobs/XX) made for a blob is made durable in blobs/ before the blob's rename,
  so the blob's directory entry cannot outlive a crash without the dir that holds it.
- quarantine/ holds at most ``QUARANTINE_KEEP`` files per cache dir (``quarantine_bytes``
  counts them, for the budget).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import plistlib
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from cachecd import errors
from cachecd.durable import full_fsync, sync_dir
from cachecd.store.crash import crash_point
from cachecd.store.quarantine import Quarantine

log = logging.getLogger(__name__)

_DIGEST_RE = re.compile(r"[0-9a-f]{32}")
_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Spotlight does not index a directory (or, at its root, a volume) that holds this file.
SPOTLIGHT_MARKER = ".metadata_never_index"
# A "sticky" Time Machine exclusion, as `tmutil addexclusion` sets it: this extended attribute
# on the item, holding a binary plist of the one string "com.apple.backupd".
TM_EXCLUDE_XATTR = "com.apple.metadata:com_apple_backup_excludeItem"
TM_EXCLUDE_VALUE = plistlib.dumps("com.apple.backupd", fmt=plistlib.FMT_BINARY)
EXCLUDE_FROM_INDEXING = sys.platform == "darwin"
# The Cache Directory Tagging spec (bford.info/cachedir): backup tools (borg, restic, tar
# --exclude-caches, ...) skip a directory holding this file when it begins with this line.
CACHEDIR_TAG = "CACHEDIR.TAG"
CACHEDIR_TAG_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by cachecd: every byte here is fetched again\n"
    "# from the Hub, and verified, when it is needed. See https://bford.info/cachedir/\n"
)
SetXattr = Callable[[Path, str, bytes], None]
# Reads while hashing a blob on disk. Small enough that the hash reads the chunk from the CPU's
# cache and that its buffer is not a fresh mapping each time: 16 K3-sized blobs in the page
# cache hashed in 60-64 ms with 64-256 KiB chunks, 145-151 ms with 4 MiB ones (this machine).
HASH_CHUNK = 256 * 1024
_IOV_MAX = 1024


def validate_digest(digest_hex: object) -> str:
    """The digest itself if it is 32 lowercase hex chars; otherwise ``InvalidRequest``."""
    if not isinstance(digest_hex, str) or not _DIGEST_RE.fullmatch(digest_hex):
        shown = repr(digest_hex)[:80]
        raise errors.InvalidRequest(
            f"invalid digest {shown}: expected 32 lowercase hex characters (xxh3-128)"
        )
    return digest_hex


def is_space_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _SPACE_ERRNOS


def hash_fd(fd: int) -> tuple[str, int]:
    """(xxh3-128 hex, byte count) of everything readable from ``fd`` from offset 0."""
    import xxhash

    h = xxhash.xxh3_128()
    offset = 0
    while True:
        chunk = os.pread(fd, HASH_CHUNK, offset)
        if not chunk:
            return h.hexdigest(), offset
        h.update(chunk)
        offset += len(chunk)


class OnDisk(NamedTuple):
    """A file found under blobs/ by a scan (a tuple of plain strs: a scan after a crash makes
    ~10^5 of these, and a tuple is made in a third less time than a frozen dataclass)."""

    dir_index: int
    name: str
    path: str
    size: int  # -1 for anything that is not a regular file (a dir, a symlink)
    placed: bool  # it sits in the subdir its name calls for (blobs/XX/XX...)


class CacheDir:
    """One cache directory. Creating it makes the layout; it does not take the lock."""

    def __init__(self, root: Path, index: int) -> None:
        self.root = Path(root)
        self.index = index
        self.blobs = self.root / "blobs"
        self.tmp = self.root / "tmp"
        self.quarantine_dir = self.root / "quarantine"
        for d in (self.root, self.blobs, self.tmp, self.quarantine_dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.quarantine = Quarantine(self.quarantine_dir)
        tag_cache_dir(self.root)
        if EXCLUDE_FROM_INDEXING:
            exclude_from_indexing(self.root)

    def blob_path(self, digest_hex: str) -> Path:
        d = validate_digest(digest_hex)
        return self.blobs / d[:2] / d

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def iter_blobs(self) -> Iterator[OnDisk]:
        """Every regular file under blobs/ (any name: the caller decides what is a stray)."""
        for sub in os.scandir(self.blobs):
            if not sub.is_dir(follow_symlinks=False):
                yield OnDisk(self.index, sub.name, sub.path, -1, False)
                continue
            for ent in os.scandir(sub.path):
                try:
                    regular = ent.is_file(follow_symlinks=False)
                    size = ent.stat(follow_symlinks=False).st_size if regular else -1
                except FileNotFoundError:
                    continue
                placed = ent.name[:2] == sub.name
                yield OnDisk(self.index, ent.name, ent.path, size, placed)

    def clear_tmp(self) -> int:
        removed = 0
        for ent in os.scandir(self.tmp):
            try:
                os.unlink(ent.path)
                removed += 1
            except IsADirectoryError:
                log.warning("event=tmp_dir_left path=%s", ent.path)
            except FileNotFoundError:
                pass
        return removed

    def move_to_quarantine(self, path: Path, reason: str) -> Path | None:
        return self.quarantine.add(path, reason)

    def quarantine_bytes(self) -> int:
        return self.quarantine.nbytes()


def tag_cache_dir(root: Path) -> None:
    """Write ``CACHEDIR_TAG`` in ``root`` unless one is there (a user's own is left alone). A
    failure is logged, not raised: a backed-up cache costs space, not correctness."""
    tag = root / CACHEDIR_TAG
    if tag.exists():
        return
    try:
        fd = os.open(tag, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(CACHEDIR_TAG_TEXT)
    except FileExistsError:
        pass
    except OSError as exc:
        log.warning("event=cachedir_tag_failed dir=%s err=%s", root, exc)


def exclude_from_indexing(root: Path, setxattr: SetXattr | None = None) -> None:
    """Keep Spotlight and Time Machine away from a cache of re-downloadable bytes (macOS).

    Writes ``SPOTLIGHT_MARKER`` in ``root`` and sets ``TM_EXCLUDE_XATTR`` on it through
    ``setxattr(path, name, value)`` (macOS's setxattr(2) unless a test passes its own). A failure
    is logged, not raised: an indexed or backed-up cache is slow, not wrong.
    """
    try:
        (root / SPOTLIGHT_MARKER).touch(exist_ok=True)
    except OSError as exc:
        log.warning("event=spotlight_exclude_failed dir=%s err=%s", root, exc)
    try:
        (setxattr or darwin_setxattr)(root, TM_EXCLUDE_XATTR, TM_EXCLUDE_VALUE)
    except OSError as exc:
        log.warning("event=tm_exclude_failed dir=%s err=%s", root, exc)


def darwin_setxattr(path: Path, name: str, value: bytes) -> None:
    """setxattr(2) as <sys/xattr.h> declares it on macOS (os.setxattr exists only on Linux)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    # Declared rather than left to ctypes' default (every int passed as a C int): the size is
    # a size_t and the position a u_int32_t.
    libc.setxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p,
                              ctypes.c_size_t, ctypes.c_uint32, ctypes.c_int]
    libc.setxattr.restype = ctypes.c_int
    if libc.setxattr(os.fsencode(path), name.encode(), value, len(value), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))


class DirLock:
    """An flock on ``DIR/lock`` held until ``release``. A second holder gets ``CacheLocked``."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / "lock"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            raise errors.CacheLocked(
                f"cache dir {root} is locked by {who}; stop that cachecd daemon "
                "(or use it) instead of starting a second one"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


class BlobDirs:
    """The set of cache dirs: locking, writing, opening and removing blobs."""

    def __init__(self, roots: list[Path], *, lock: bool = True) -> None:
        if not roots:
            raise errors.InvalidRequest("no cache dir given")
        self.dirs = [CacheDir(Path(r), i) for i, r in enumerate(roots)]
        self._locks: list[DirLock] = []
        if lock:
            try:
                for d in self.dirs:
                    self._locks.append(DirLock(d.root))
            except BaseException:
                self.release()
                raise

    def release(self) -> None:
        for lk in self._locks:
            lk.release()
        self._locks.clear()

    def path(self, dir_index: int, digest_hex: str) -> Path:
        return self.dirs[dir_index].blob_path(digest_hex)

    def choose_dir(self, nbytes: int) -> CacheDir:
        """A dir picked at random weighted by free space, so SSDs fill evenly."""
        if len(self.dirs) == 1:
            return self.dirs[0]
        frees = [max(d.free_bytes() - nbytes, 0) for d in self.dirs]
        if not any(frees):
            return max(self.dirs, key=lambda d: d.free_bytes())
        return random.choices(self.dirs, weights=frees)[0]

    def write_blob(self, digest_hex: str, data: bytes | memoryview) -> int:
        """Write, fsync, rename into place, fsync the dir. Returns the dir index used."""
        writer = self.begin(digest_hex, len(data))
        try:
            writer.write(0, data)
        except BaseException:
            writer.abort()
            raise
        return writer.finish()

    def begin(self, digest_hex: str, nbytes: int) -> BlobWriter:
        """A temp file for ``nbytes`` of blob ``digest_hex``, filled by ``BlobWriter.write``."""
        return BlobWriter(self.choose_dir(nbytes), validate_digest(digest_hex), nbytes)

    def open_read(self, dir_index: int, digest_hex: str) -> tuple[int, int]:
        """(fd, size) of a blob; raises FileNotFoundError if it is gone."""
        fd = os.open(self.path(dir_index, digest_hex), _READ_FLAGS)
        try:
            return fd, os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise

    def unlink(self, dir_index: int, digest_hex: str) -> bool:
        try:
            os.unlink(self.path(dir_index, digest_hex))
            return True
        except FileNotFoundError:
            return False

    def quarantine(self, dir_index: int, digest_hex: str, reason: str) -> Path | None:
        cdir = self.dirs[dir_index]
        return cdir.move_to_quarantine(cdir.blob_path(digest_hex), reason)

    def quarantine_bytes(self) -> int:
        """Bytes quarantine/ holds in every cache dir (counted against the budget)."""
        return sum(d.quarantine_bytes() for d in self.dirs)


class BlobWriter:
    """One blob on its way in: a temp file written in pieces (any order, any thread), then
    ``finish`` (fsync, rename into place, fsync the dir) or ``abort`` (the temp is removed).

    Writes of disjoint pieces may run on several threads at once. Writeback is left to the kernel
    and to ``finish``'s fsync: starting it per piece made the disk compete with the download
    (bench/README.md, 2026-12-03).
    """

    def __init__(self, cdir: CacheDir, digest: str, nbytes: int) -> None:
        self.cdir, self.digest, self.nbytes = cdir, digest, nbytes
        self.tmp = cdir.tmp / f"{digest}.{os.getpid()}.{time.time_ns()}"
        try:
            self._fd: int | None = os.open(self.tmp, _TMP_FLAGS, 0o600)
        except OSError as exc:
            self._raise_space_error(exc)
            raise

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Bytes ``data`` at ``offset``; raises ``DiskFull`` on ENOSPC (the temp stays)."""
        fd = self._fd
        if fd is None:
            raise errors.Internal(f"write to blob {self.digest} after it was finished or aborted")
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        except OSError as exc:
            self._raise_space_error(exc)
            raise

    def writev(self, offset: int, views: list[memoryview]) -> None:
        """The buffers back to back at ``offset`` (one ``pwritev`` when the kernel takes it all)."""
        fd = self._fd
        if fd is None or not hasattr(os, "pwritev") or len(views) > _IOV_MAX:
            self.write(offset, b"".join(views))
            return
        total = sum(len(v) for v in views)
        try:
            done = os.pwritev(fd, views, offset)
        except OSError as exc:
            self._raise_space_error(exc)
            raise
        if done < total:  # a short write: finish the rest the simple way
            self.write(offset + done, b"".join(views)[done:])

    def open_reader(self) -> int:
        """A read-only fd of the temp file: it stays valid across ``finish`` or ``abort``."""
        if self._fd is None:
            raise errors.Internal(f"blob {self.digest} was already finished or aborted")
        return os.open(self.tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def finish(self) -> int:
        """fsync, rename into place, fsync the dir; returns the dir index. The temp goes on
        failure."""
        fd, self._fd = self._fd, None
        if fd is None:
            raise errors.Internal(f"blob {self.digest} was already finished or aborted")
        try:
            try:
                crash_point("after_tmp_write")
                full_fsync(fd)
                crash_point("after_fsync")
            finally:
                os.close(fd)
            final = self.cdir.blob_path(self.digest)
            if not final.parent.is_dir():
                final.parent.mkdir(mode=0o700, exist_ok=True)
                sync_dir(final.parent.parent)  # the new fan-out dir's entry in blobs/
            os.rename(self.tmp, final)
            crash_point("after_rename")
            sync_dir(final.parent)
        except OSError as exc:
            _unlink_quiet(self.tmp)
            self._raise_space_error(exc)
            raise
        except BaseException:
            _unlink_quiet(self.tmp)
            raise
        return self.cdir.index

    def abort(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            _unlink_quiet(self.tmp)

    def _raise_space_error(self, exc: OSError) -> None:
        if is_space_error(exc):
            raise errors.DiskFull(
                f"no space left in cache dir {self.cdir.root} writing {self.nbytes} bytes; "
                "free space or lower the budget"
            ) from exc


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("event=tmp_unlink_failed path=%s err=%s", path, exc)
