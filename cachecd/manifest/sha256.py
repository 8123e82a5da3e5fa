"""A file's sha256 as the Hub lists it for an LFS file: how an installed file, a local folder's
shard or another revision's copy is checked against the manifest's pin."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    """The hex sha256 of the whole file at ``path``, read 1 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
