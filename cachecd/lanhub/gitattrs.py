"""Which files of a folder the Hub would keep in LFS, and which in git as plain blobs.

The Hub stores a file in LFS when the repo's ``.gitattributes`` gives it ``filter=lfs`` (a repo
made on the Hub starts with a list of binary extensions, ``HUB_DEFAULT``) or when it is 10 MB or
larger (the Hub refuses bigger plain files); every other file is a git blob, identified by its
git blob id (sha1 over ``blob SIZE\\0`` + bytes), with no sha256 on the Hub's side.

Invariants:
- A folder with its own ``.gitattributes`` is judged by its ``filter=lfs`` lines only; one
  without is judged by ``HUB_DEFAULT``. Either way a file of ``PLAIN_LIMIT`` bytes or more is LFS.
- Patterns follow gitattributes' rules as far as a Hub repo uses them: a pattern with no ``/``
  matches the file's name in any folder, one with a ``/`` matches the path from the repo's root,
  ``**`` spans folders.
"""

from __future__ import annotations

import hashlib
import re
from fnmatch import translate
from pathlib import Path

PLAIN_LIMIT = 10 * 1024 * 1024  # the Hub's limit for a file kept in git
HUB_DEFAULT = (
    "*.7z *.arrow *.bin *.bz2 *.ckpt *.ftz *.gz *.h5 *.joblib *.lfs.* *.mlmodel *.model "
    "*.msgpack *.npy *.npz *.onnx *.ot *.parquet *.pb *.pickle *.pkl *.pt *.pth *.rar "
    "*.safetensors saved_model/**/* *.tar.* *.tar *.tflite *.tgz *.wasm *.xz *.zip *.zst "
    "*tfevents*"
).split()
_MAX_ATTRS_BYTES = 1 << 20


class LfsRule:
    """``rule.lfs(relpath, size)``: whether the Hub would keep that file in LFS."""

    def __init__(self, patterns: list[str]) -> None:
        self._names = [re.compile(translate(p)) for p in patterns if "/" not in p.strip("/")]
        self._paths = [re.compile(_path_regex(p.strip("/"))) for p in patterns
                       if "/" in p.strip("/")]

    @classmethod
    def for_folder(cls, repo_root: Path) -> LfsRule:
        """From ``repo_root/.gitattributes`` when there is one, else the Hub's default list."""
        try:
            with open(repo_root / ".gitattributes", encoding="utf-8", errors="replace") as fh:
                text = fh.read(_MAX_ATTRS_BYTES)
        except OSError:
            return cls(HUB_DEFAULT)
        patterns = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) > 1 and not parts[0].startswith("#") and "filter=lfs" in parts[1:]:
                patterns.append(parts[0])
        return cls(patterns)

    def lfs(self, relpath: str, size: int) -> bool:
        if size >= PLAIN_LIMIT:
            return True
        name = relpath.rsplit("/", 1)[-1]
        return any(r.match(name) for r in self._names) or any(r.match(relpath)
                                                             for r in self._paths)


def _path_regex(pattern: str) -> str:
    """fnmatch's translation, with ``*`` kept inside one folder and ``**/`` spanning folders."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out) + r"\Z"


def git_blob_id(path: Path) -> str:
    """The git blob id of a (small) file: what the Hub gives as its ETag and ``oid``."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
