"""A folder seen as a Hub model repo: its files, their sha256, its commit.

Invariants:
- A repo's files are the regular files under its folder, walked without following directory
  symlinks, minus any path with a ``.git`` component and the top-level ``.cache`` folder
  (where ``hf download --local-dir`` keeps its bookkeeping). A file symlink counts only if its
  real path stays inside the repo folder. Nothing outside that set is ever listed or served.
- A folder that is exactly an ``hf download --local-dir`` of one commit is served as that
  commit, each file with the sha256 (or git blob id) the Hub gave (``mirror``).
- Otherwise the commit is sha1 over ``f"{relpath}\\0{sha256hex}\\n"`` for every file, sorted by
  relative posix path (Python string order): same bytes -> same commit, any change -> a new one.
- A file's sha256 is cached by (real path, size, mtime_ns) and computed once per key even when
  many threads ask at the same time; hashing streams in fixed chunks and never holds a file.
  A server also keeps what it computed in a sidecar file, so a restart does not hash again.
- A file is presented as the Hub presents it: an LFS file by its sha256 (``lfs.sha256`` ==
  the ETag), a file the Hub keeps in git by its git blob id (``gitattrs`` says which is which;
  a download record, where there is one, says so for its file).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachecd.lanhub.gitattrs import LfsRule, git_blob_id
from cachecd.lanhub.mirror import Record, Sidecar, read_record, recorded_commit

log = logging.getLogger(__name__)

_CHUNK = 8 * 1024 * 1024
_MAX_PATH = 4096
_EXCLUDED_TOP = frozenset({".cache"})
_EXCLUDED_ANY = frozenset({".git"})
_LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {size}\n"


@dataclass(frozen=True)
class RepoFile:
    relpath: str
    real: Path
    size: int
    mtime_ns: int
    sha256: str
    git_oid: str | None = None  # a small file the Hub keeps in git (hf download's record): no LFS
    xet_hash: str | None = None  # a large file's Xet hash, where the hub serves Xet (xet_routes)


@dataclass(frozen=True)
class RepoSnapshot:
    repo_id: str
    commit: str
    files: dict[str, RepoFile]  # relpath -> file, in sorted order
    recorded: bool = False  # the commit is the one hf download recorded, not content-derived

    @property
    def last_modified(self) -> float:
        return max((f.mtime_ns for f in self.files.values()), default=0) / 1e9


# ---------------------------------------------------------------- names and paths


def valid_relpath(path: str) -> bool:
    """A relative posix path with no empty, ``.`` or ``..`` part, no backslash and no NUL."""
    if not path or len(path) > _MAX_PATH or "\\" in path or "\0" in path:
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


def excluded(relpath: str) -> bool:
    parts = relpath.split("/")
    return parts[0] in _EXCLUDED_TOP or any(p in _EXCLUDED_ANY for p in parts)


# ---------------------------------------------------------------- hashing


class HashCache:
    """sha256 of files keyed by (real path, size, mtime_ns); one hashing per key at a time."""

    def __init__(self) -> None:
        self._done: dict[tuple[str, int, int], str] = {}
        self._latest: dict[str, tuple[str, int, int]] = {}  # path -> its newest key
        self._locks: dict[tuple[str, int, int], threading.Lock] = {}
        self._guard = threading.Lock()
        self._sidecars: dict[Path | None, Sidecar] = {}
        # Small plain files: path -> (size, mtime_ns, git blob id), the newest stat only.
        self._oids: dict[str, tuple[int, int, str]] = {}

    def sidecar(self, path: Path | None) -> Sidecar:
        """The hashes kept in the file ``path`` (None: in memory only), one object per file."""
        with self._guard:
            return self._sidecars.setdefault(path, Sidecar(path))

    def cached(self, real: Path, size: int, mtime_ns: int) -> str | None:
        return self._done.get((str(real), size, mtime_ns))

    def seed(self, real: Path, size: int, mtime_ns: int, sha256: str) -> None:
        """Trust a sha256 known from elsewhere (a manifest, an earlier run) for this exact stat."""
        self._store((str(real), size, mtime_ns), sha256)

    def _store(self, key: tuple[str, int, int], sha256: str) -> None:
        # A file's older keys can never match again: drop them so a long-lived server stays small.
        with self._guard:
            old = self._latest.get(key[0])
            if old is not None and old != key:
                self._done.pop(old, None)
            self._latest[key[0]] = key
            self._done[key] = sha256

    def git_oid(self, real: Path, size: int, mtime_ns: int) -> str:
        """The git blob id of a small plain file, read once per (path, size, mtime_ns)."""
        found = self._oids.get(str(real))
        if found is not None and found[:2] == (size, mtime_ns):
            return found[2]
        oid = git_blob_id(real)
        self._oids[str(real)] = (size, mtime_ns, oid)
        return oid

    def sha256(self, real: Path, size: int, mtime_ns: int) -> str:
        key = (str(real), size, mtime_ns)
        found = self._done.get(key)
        if found is not None:
            return found
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            found = self._done.get(key)
            if found is None:
                found = _hash_file(real)
                self._store(key, found)
        with self._guard:
            self._locks.pop(key, None)
        return found


def _hash_file(path: Path) -> str:
    started = time.monotonic()
    digest = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    total = 0
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            digest.update(view[:n])  # large updates release the GIL
            total += n
    log.debug("hashed path=%s bytes=%d seconds=%.3f", path.name, total, time.monotonic() - started)
    return digest.hexdigest()


# One per process: repo_commit() and every in-process server reuse what was hashed.
SHARED_HASHES = HashCache()


# ---------------------------------------------------------------- listing and commit


def _walk(repo_dir: Path) -> list[tuple[str, Path, os.stat_result]]:
    """(relpath, real path, stat) of every file of the repo, sorted by relpath."""
    real_root = repo_dir.resolve()
    out: list[tuple[str, Path, os.stat_result]] = []
    for dirpath, dirnames, filenames in os.walk(real_root, followlinks=False):
        base = Path(dirpath)
        rel_dir = base.relative_to(real_root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if not excluded(prefix + d)]
        for name in filenames:
            relpath = prefix + name
            if excluded(relpath) or not valid_relpath(relpath):
                continue
            entry = _regular_inside(base / name, real_root)
            if entry is not None:
                out.append((relpath, *entry))
    out.sort(key=lambda item: item[0])
    return out


def _regular_inside(path: Path, real_root: Path) -> tuple[Path, os.stat_result] | None:
    """The real path and stat of ``path`` if it is a regular file inside ``real_root``."""
    try:
        real = path
        if path.is_symlink():
            # Check the link text first so a link pointing out is never followed at all.
            target = Path(os.path.normpath(path.parent / os.readlink(path)))
            if not target.is_relative_to(real_root):
                return None
            real = path.resolve(strict=True)
        st = real.stat()
    except (OSError, RuntimeError):  # dangling or looping symlink, vanished file
        return None
    if not stat.S_ISREG(st.st_mode) or not real.is_relative_to(real_root):
        return None
    return real, st


def snapshot(
    repo_dir: Path, repo_id: str = "", cache: HashCache | None = None, kept: Path | None = None
) -> RepoSnapshot:
    """The repo's files with their sha256 and its commit: the one ``hf download`` recorded when
    the folder is exactly that download (``mirror``), else the content-derived one.
    Hashes computed are kept in the file ``kept`` too (a server's sidecar). Blocking: call in a
    thread."""
    cache = cache or SHARED_HASHES
    root = repo_dir.resolve()
    sidecar = cache.sidecar(kept)
    files: dict[str, RepoFile] = {}
    records: dict[str, Record | None] = {}
    commit = hashlib.sha1()
    rule = LfsRule.for_folder(root)
    for relpath, real, st in _walk(repo_dir):
        record = records[relpath] = read_record(root, relpath, st)
        try:
            sha = (record and record.sha256) or _sha256(cache, sidecar, relpath, real, st)
        except OSError as exc:  # removed or made unreadable since the walk: not part of it
            log.warning("skipping file=%s error=%s", relpath, exc.__class__.__name__)
            del records[relpath]
            continue
        try:
            oid = _git_oid(record, rule, cache, relpath, real, st)
        except OSError as exc:
            log.warning("skipping file=%s error=%s", relpath, exc.__class__.__name__)
            del records[relpath]
            continue
        files[relpath] = RepoFile(relpath, real, st.st_size, st.st_mtime_ns, sha, oid)
        commit.update(f"{relpath}\0{sha}\n".encode())
    sidecar.flush(set(files))
    recorded, why = recorded_commit(records)
    name = repo_id or repo_dir.name
    if recorded is None and any(records.values()) and why != sidecar.said:
        sidecar.said = why  # say it once per change, not at every request
        log.warning("not serving the recorded commit repo=%s reason=%s", name, why)
    return RepoSnapshot(name, recorded or commit.hexdigest(), files, recorded is not None)


def _git_oid(record: Record | None, rule: LfsRule, cache: HashCache, relpath: str, real: Path,
             st: os.stat_result) -> str | None:
    """A file's git blob id where the Hub keeps it in git (its record says so, or ``rule``)."""
    if record is not None:
        return record.git_oid
    if rule.lfs(relpath, st.st_size):
        return None
    return cache.git_oid(real, st.st_size, st.st_mtime_ns)


def _sha256(cache: HashCache, sidecar: Sidecar, relpath: str, real: Path,
            st: os.stat_result) -> str:
    """From the sidecar of an earlier run, else from memory or hashed now (then kept)."""
    size, mtime_ns = st.st_size, st.st_mtime_ns
    kept = sidecar.get(relpath, size, mtime_ns)
    if kept is not None:
        if cache.cached(real, size, mtime_ns) is None:
            cache.seed(real, size, mtime_ns, kept)
        return kept
    sha = cache.sha256(real, size, mtime_ns)  # memory first, else hashed once
    sidecar.put(relpath, size, mtime_ns, sha)
    return sha


def repo_commit(repo_dir: Path) -> str:
    """The content-derived 40-hex commit of a repo folder (see the module docstring)."""
    return snapshot(Path(repo_dir)).commit


# ---------------------------------------------------------------- Hub JSON shapes


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(f: RepoFile) -> tuple[bytes, str]:
    """The LFS pointer git holds for the file, and its blob id."""
    pointer = _LFS_POINTER.format(sha=f.sha256, size=f.size).encode()
    return pointer, _git_blob_sha1(pointer)


def _lfs_fields(f: RepoFile) -> tuple[str, dict[str, Any]]:
    """(blob id, lfs dict without its hash key) as git would store the file's LFS pointer."""
    pointer, blob_id = lfs_pointer(f)
    return blob_id, {"size": f.size, "pointerSize": len(pointer)}


def iso_time(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + ".000Z"


def model_info_json(snap: RepoSnapshot) -> dict[str, Any]:
    """What ``HfApi.model_info`` parses: id, sha, lastModified, siblings with sizes and LFS."""
    siblings = []
    for f in snap.files.values():
        if f.git_oid is not None:  # kept in git on the Hub: a blob id, no LFS
            siblings.append({"rfilename": f.relpath, "size": f.size, "blobId": f.git_oid})
            continue
        blob_id, lfs = _lfs_fields(f)
        siblings.append(
            {
                "rfilename": f.relpath,
                "size": f.size,
                "blobId": blob_id,
                "lfs": {**lfs, "sha256": f.sha256},
            }
        )
    org = snap.repo_id.split("/")[0]
    return {
        "_id": snap.commit[:24],
        "id": snap.repo_id,
        "modelId": snap.repo_id,
        "author": org,
        "sha": snap.commit,
        "lastModified": iso_time(snap.last_modified),
        "createdAt": iso_time(snap.last_modified),
        "private": False,
        "gated": False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "siblings": siblings,
        "usedStorage": sum(f.size for f in snap.files.values()),
    }


def tree_json(snap: RepoSnapshot, prefix: str, recursive: bool) -> list[dict[str, Any]] | None:
    """What ``HfApi.list_repo_tree`` parses, for the folder ``prefix`` ("" is the root).

    None when ``prefix`` is not a folder of the repo (missing, or a file).
    """
    base = prefix + "/" if prefix else ""
    below = [f for f in snap.files.values() if f.relpath.startswith(base)]
    if prefix and not below:
        return None
    folders: dict[str, list[RepoFile]] = {}
    entries: list[dict[str, Any]] = []
    for f in below:
        rest = f.relpath[len(base) :].split("/")
        for depth in range(1, len(rest) if recursive else min(2, len(rest))):
            folders.setdefault(base + "/".join(rest[:depth]), []).append(f)
        if recursive or len(rest) == 1:
            entries.append(file_entry(f))
    for path, members in folders.items():
        entries.append(
            {"type": "directory", "oid": _tree_oid(path, members), "size": 0, "path": path}
        )
    entries.sort(key=lambda e: e["path"])
    return entries


def file_entry(f: RepoFile) -> dict[str, Any]:
    if f.git_oid is not None:
        return {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.relpath}
    blob_id, lfs = _lfs_fields(f)
    entry = {
        "type": "file",
        "oid": blob_id,
        "size": f.size,
        "path": f.relpath,
        "lfs": {**lfs, "oid": f.sha256},
    }
    if f.xet_hash is not None:
        entry["xetHash"] = f.xet_hash
    return entry


def _tree_oid(path: str, members: list[RepoFile]) -> str:
    # Not git's tree hash, but stable and content-derived, which is all a client may rely on.
    digest = hashlib.sha1(path.encode() + b"\0")
    for f in members:
        digest.update(f"{f.relpath}\0{f.sha256}\n".encode())
    return digest.hexdigest()
