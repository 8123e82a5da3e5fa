"""A repo folder made by ``hf download --local-dir``: the commit and hashes it really has.

huggingface_hub leaves ``REPO/.cache/huggingface/download/<path>.metadata`` for every file it
downloaded: three lines, the commit, the file's etag (an LFS file's sha256, a small file's git
blob id) and the time the record was written. It trusts a record only while the file's mtime is
at most a second past that time (``huggingface_hub._local_folder.read_download_metadata``); so
does this module, which reads the records and never writes or removes one.

Invariants:
- The real commit is served only when every file of the repo has a trusted record and all the
  records name one commit; otherwise the folder is not that commit, and the content-derived one
  is served (``repo``).
- An LFS file with a trusted record is never hashed: its record is its sha256.
- A sha256 a server computes is kept in a sidecar file per repo, outside the repo folder
  (``DIR/.cache/cachecd/sha256/ORG--NAME.json``, a path no route reaches), under the file's path
  with its size and mtime_ns; an entry is used only while both are unchanged. The sidecar is
  written to a temp name and renamed, so it is whole or absent; where it cannot be written
  (a read-only folder) hashes stay in memory (one warning).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("cachecd.lanhub.server")

RECORDS = Path(".cache", "huggingface", "download")
SIDECARS = Path(".cache", "cachecd", "sha256")  # under the served DIR, beside the repos
SHA256 = re.compile(r"[0-9a-f]{64}")
GIT_OID = re.compile(r"[0-9a-f]{40}")
_MTIME_SLACK_S = 1.0  # huggingface_hub's own allowance for an imprecise mtime


@dataclass(frozen=True)
class Record:
    commit: str
    etag: str  # an LFS file's sha256, or a small file's git blob id

    @property
    def sha256(self) -> str | None:
        return self.etag if SHA256.fullmatch(self.etag) else None

    @property
    def git_oid(self) -> str | None:
        return self.etag if GIT_OID.fullmatch(self.etag) else None


def read_record(repo_root: Path, relpath: str, st: os.stat_result) -> Record | None:
    """huggingface_hub's record of the file, if there is one it would still trust."""
    try:
        with open(repo_root / RECORDS / f"{relpath}.metadata") as fh:
            commit, etag, stamp = (fh.readline().strip() for _ in range(3))
        timestamp = float(stamp)
    except (OSError, ValueError):
        return None
    if not GIT_OID.fullmatch(commit) or not (SHA256.fullmatch(etag) or GIT_OID.fullmatch(etag)):
        return None
    if st.st_mtime - _MTIME_SLACK_S > timestamp:  # changed since it was downloaded
        return None
    return Record(commit, etag)


def recorded_commit(records: dict[str, Record | None]) -> tuple[str | None, str]:
    """(the one commit every file's record names, or None and why not)."""
    missing = sorted(p for p, r in records.items() if r is None)
    commits = {r.commit for r in records.values() if r is not None}
    if not commits:
        return None, "no download records"
    if missing:
        return None, f"{len(missing)} file(s) without a trusted record, e.g. {missing[0]}"
    if len(commits) > 1:
        return None, f"records name {len(commits)} commits: {', '.join(sorted(commits))}"
    return commits.pop(), ""


def sidecar_path(root: Path, key: str) -> Path:
    """Where a server over ``root`` keeps the hashes of the repo ``key`` (``org/name``,
    ``datasets/org/name``)."""
    return root / SIDECARS / (key.replace("/", "--") + ".json")


class Sidecar:
    """Hashes a server computed for one repo folder, kept across restarts (``path`` None: in
    memory only)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: dict[str, list[object]] | None = None
        self._dirty = False
        self._lock = threading.Lock()
        self._warned = False
        self.said = ""  # the last reason logged for not serving a recorded commit

    def _load(self) -> dict[str, list[object]]:
        if self._entries is None and self.path is None:
            self._entries = {}
        if self._entries is None:
            assert self.path is not None
            try:
                data = json.loads(self.path.read_text())
                entries = data["files"] if data.get("version") == 1 else {}
                self._entries = entries if isinstance(entries, dict) else {}
            except (OSError, ValueError, KeyError, AttributeError):
                self._entries = {}
        return self._entries

    def get(self, relpath: str, size: int, mtime_ns: int) -> str | None:
        with self._lock:
            entry = self._load().get(relpath)
        if isinstance(entry, list) and len(entry) == 3 and entry[:2] == [size, mtime_ns]:
            sha = entry[2]
            return sha if isinstance(sha, str) and SHA256.fullmatch(sha) else None
        return None

    def put(self, relpath: str, size: int, mtime_ns: int, sha256: str) -> None:
        with self._lock:
            self._load()[relpath] = [size, mtime_ns, sha256]
            self._dirty = True

    def flush(self, keep: set[str]) -> None:
        """Write the entries of the files in ``keep`` if any changed since the last write."""
        with self._lock:
            entries = self._load()
            gone = set(entries) - keep
            if not self._dirty and not gone:
                return
            for relpath in gone:
                del entries[relpath]
            text = json.dumps({"version": 1, "files": entries}, separators=(",", ":"))
            self._dirty = False
        if self.path is None:
            return
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp.", dir=self.path.parent)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.replace(tmp, self.path)
        except OSError as exc:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            if not self._warned:
                self._warned = True
                log.warning("hash sidecar not written path=%s error=%s: hashes stay in memory",
                            self.path, exc)
