"""Bounds on input from outside, checked before it is parsed: JSON (a manifest's meta, a
safetensors header, a repo's config and index) and a manifest's zip archive.

Invariant: bad input of any shape gets ``ManifestInvalid`` naming the file and the field, in one
line, and costs memory in proportion to its size: never a ``RecursionError`` (Python's json
recurses once per nesting level, and an uncaught one took the daemon down with every model it
served) nor an archive that expands a thousandfold (deflate allows ~1,000:1; a 1 MB manifest
took 1.2 GiB before it was refused).

- JSON must be UTF-8 (json.loads would also take UTF-16/32, whose brackets this scan cannot see),
  at most ``max_bytes`` long, and nested at most ``MAX_DEPTH`` deep, counted before parsing.
- An archive's members together expand to at most ``EXPANSION`` times its size (or
  ``EXPANSION_FLOOR``), as their zip headers declare (zipfile reads no further than that), and
  each ``.npy`` header's shape and dtype must fit its member: both read before any column is.
"""

from __future__ import annotations

import io
import json
import zipfile
from typing import Any

import numpy as np

from cachecd import errors

MAX_DEPTH = 32  # a manifest's meta is 4 deep, a safetensors header 3, a config.json a handful
MAX_JSON_BYTES = 64 << 20  # a K3 meta or index.json is a few MB; headers have their own limit
MAX_ARCHIVE_BYTES = 1 << 30  # a K3-sized manifest is tens of MB
EXPANSION = 64  # a real manifest expands ~3x (its digests do not compress)
EXPANSION_FLOOR = 64 << 20
_CHUNK = 1 << 20
_NOT_SPECIAL = bytes(b for b in range(256) if b not in b'[]{}"')


def nesting_depth(data: bytes) -> int:
    """How deep ``data``'s arrays and objects nest, brackets inside strings not counted. Where
    ``data`` stops being JSON the count may be off, but the parser stops there too, so the
    depth it would reach is counted right."""
    if b"\\" in data:  # escapes first (outside a string a backslash is not JSON)
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Every quote left opens or closes a string: keep quotes and brackets only, then drop what
    # lies between a quote and the next.
    kept = data.translate(None, _NOT_SPECIAL)
    brackets = b"".join(kept.split(b'"')[::2])
    depth = peak = 0
    for start in range(0, len(brackets), _CHUNK):  # in chunks: memory stays a few MB
        a = np.frombuffer(brackets, np.uint8, min(_CHUNK, len(brackets) - start), start)
        run = np.cumsum(np.where((a == ord("[")) | (a == ord("{")), 1, -1), dtype=np.int64)
        peak = max(peak, depth + int(run.max()))
        depth += int(run[-1])
    return peak


def loads(data: bytes, source: str, field: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """``json.loads`` within the bounds of the module docstring; ``ManifestInvalid`` naming
    ``source`` and ``field`` otherwise."""
    if len(data) > max_bytes:
        raise errors.ManifestInvalid(
            f"{source}: {field}: {len(data)} bytes of JSON, over the {max_bytes}-byte limit")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.ManifestInvalid(f"{source}: {field}: not UTF-8 ({exc})") from None
    depth = nesting_depth(data)
    if depth > MAX_DEPTH:
        raise errors.ManifestInvalid(
            f"{source}: {field}: JSON nested {depth} deep, over the limit of {MAX_DEPTH}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise errors.ManifestInvalid(f"{source}: {field}: bad JSON ({exc})") from None


def check_archive_sizes(data: bytes, source: str) -> None:
    """Refuse a manifest archive that is too big, or whose columns would expand or allocate out
    of proportion to it, before anything is decompressed beyond the ``.npy`` headers."""
    if len(data) > MAX_ARCHIVE_BYTES:
        raise errors.ManifestInvalid(
            f"{source}: {len(data)} bytes, over the {MAX_ARCHIVE_BYTES}-byte manifest limit")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            members = zf.infolist()
            _check_expansion(members, len(data), source)
            for info in members:
                _check_member(zf, info, source)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise errors.ManifestInvalid(
            f"{source}: not a cachecd manifest archive ({type(exc).__name__}: {exc})") from None


def _check_expansion(members: list[zipfile.ZipInfo], size: int, source: str) -> None:
    expanded = sum(info.file_size for info in members)
    allowed = max(EXPANSION_FLOOR, EXPANSION * size)
    if expanded > allowed:
        biggest = max(members, key=lambda info: info.file_size)
        raise errors.ManifestInvalid(
            f"{source}: {biggest.filename.removesuffix('.npy')}: the archive's {size} bytes "
            f"would expand to {expanded}, over the {allowed}-byte limit ({EXPANSION}x its size)")


def _check_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, source: str) -> None:
    field = info.filename.removesuffix(".npy")
    with zf.open(info) as f:
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, _fortran, dtype = read(f)
        header = f.tell()
    count = int(np.prod(shape, dtype=object))  # object: no int64 overflow on a hostile shape
    if dtype.hasobject or header + count * dtype.itemsize > info.file_size:
        raise errors.ManifestInvalid(
            f"{source}: {field}: its header says {dtype}{list(shape)}, which "
            f"{info.file_size} bytes cannot hold")
