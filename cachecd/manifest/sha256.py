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


def git_blob_id(data: bytes) -> str:
    """The id git gives ``data`` as a blob (sha1 of ``blob <size>\\0`` and the bytes): what a
    commit's tree pins for a file kept in git, not LFS (the Hub's tree ``oid``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
