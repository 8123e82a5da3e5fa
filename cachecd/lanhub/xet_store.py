"""The hub's Xet store: each large file cut into chunks and packed into xorbs, once, on disk.

Layout, beside the sha256 sidecars (``DIR/.cache/cachecd/``, a path no route reaches), under
``xet/{scheme}-{xorb bytes}/`` (one folder per way of packing): ``xorbs/{xorb hash}`` the serialized xorbs (chunk headers and payloads, no footer),
``files/{xet hash}.json`` a file's chunks (hash, size) and its xorbs (hash, chunk count,
each chunk's byte offset), ``sha/{sha256}-{size}`` the xet hash of the file with that sha256.

Invariants:
- A file is built at most once per (sha256, size), one build at a time per file, in a thread;
  the files and xorbs are written to a temp name and renamed, so each is whole or absent, and the
  file's index is written last: an index on disk names only xorbs that are there.
- Xorbs are content-addressed: a xorb another file already wrote is reused as it is.
- Cuts, chunk hashes and the file hash are ``cachecd.xet``'s (checked against hf_xet in tests);
  a file is read in 64 MiB blocks and re-cut from the last cut of each block, which gives the
  one-pass cuts because the chunker restarts at every cut.
- Cost: one read of the file, the gear hash (numpy on one core: 20-40 MB/s measured on a loaded
  2-core machine, the slow part), BLAKE3 and LZ4 per chunk: a 5 GB shard takes minutes the first
  time it is asked for, and its xorbs about its size again on disk (less where LZ4 shrinks).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from cachecd.xet import chunking, hashing, xorb

log = logging.getLogger("cachecd.lanhub.server")

XET_DIR = Path(".cache", "cachecd", "xet")
_READ = 64 * 1024 * 1024
_KEEP = 32  # parsed indexes kept in memory
SCHEMES = {"lz4": xorb.LZ4, "none": xorb.NONE, "bg4": xorb.BG4_LZ4, "mixed": -1}


@dataclass(frozen=True)
class XorbSpan:
    hash: str  # hex
    first: int  # index of its first chunk in the file
    offsets: list[int]  # byte offset of each chunk's header in the xorb, then the xorb's end

    @property
    def count(self) -> int:
        return len(self.offsets) - 1


@dataclass(frozen=True)
class XetFile:
    xet_hash: str  # hex
    size: int
    leaves: list[hashing.Node]
    starts: list[int]  # file offset of each chunk, then the file's size
    xorbs: list[XorbSpan]

    def chunk_at(self, offset: int) -> int:
        """Index of the chunk holding byte ``offset``."""
        lo, hi = 0, len(self.leaves) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.starts[mid] <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _writable(path: Path) -> Path:
    """``path``, or a folder of this process's own where it cannot be written (a read-only
    served folder): the xorbs are then built again by the next server."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return path
    except OSError as exc:
        fallback = Path(tempfile.mkdtemp(prefix="cachecd-xet-"))
        atexit.register(shutil.rmtree, fallback, True)
        log.warning("xet store not writable path=%s error=%s: using %s", path, exc, fallback)
        return fallback


class _Packer:
    """Chunks into xorbs of at most ``limit`` bytes, each written out as it fills."""

    def __init__(self, store: XetStore) -> None:
        self.store = store
        self.builder = xorb.XorbBuilder(scheme=store.scheme_code())
        self.spans: list[XorbSpan] = []
        self.leaves: list[hashing.Node] = []

    def add(self, data: memoryview) -> None:
        leaf = (hashing.chunk_hash(data), len(data))
        full = self.builder.full(len(data)) or (
            self.builder.leaves and self.builder.offsets[-1] + len(data) > self.store.xorb_bytes)
        if full:
            self.flush()
        scheme = None
        if self.store.scheme == "mixed":  # every decoder exercised: none, LZ4, BG4 in turn
            scheme = len(self.leaves) % 3
            self.builder.parts.append(xorb.encode_chunk(data, scheme))
            self.builder.leaves.append(leaf)
            self.builder.offsets.append(self.builder.offsets[-1] + len(self.builder.parts[-1]))
        else:
            self.builder.add(data, leaf)
        self.leaves.append(leaf)

    def flush(self) -> None:
        b = self.builder
        if not b.leaves:
            return
        name = hashing.to_hex(b.hash())
        path = self.store.dir / "xorbs" / name
        if not path.exists():
            _write_atomic(path, b.serialize())
        self.spans.append(XorbSpan(name, len(self.leaves) - len(b.leaves), list(b.offsets)))
        self.builder = xorb.XorbBuilder(scheme=self.store.scheme_code())


class XetStore:
    """Builds and finds files' Xet data under ``root`` (the served DIR)."""

    def __init__(self, root: Path, *, scheme: str = "lz4",
                 xorb_bytes: int = xorb.MAX_XORB_BYTES) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"xet scheme {scheme!r}: one of {', '.join(SCHEMES)}")
        self.scheme = scheme
        self.xorb_bytes = min(xorb_bytes, xorb.MAX_XORB_BYTES)
        # One folder per way of building: the same file packed otherwise has other xorbs.
        self.dir = _writable(root / XET_DIR / f"{scheme}-{self.xorb_bytes}")
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._memo: dict[tuple[str, int], str] = {}
        self._files: OrderedDict[str, XetFile] = OrderedDict()

    def scheme_code(self) -> int:
        code = SCHEMES[self.scheme]
        return xorb.LZ4 if code < 0 else code

    def xorb_path(self, xorb_hash: str) -> Path | None:
        """The xorb's file, if this store holds it (``xorb_hash`` checked as 64 hex digits)."""
        if len(xorb_hash) != 64 or any(c not in "0123456789abcdef" for c in xorb_hash):
            return None
        path = self.dir / "xorbs" / xorb_hash
        return path if path.is_file() else None

    def xet_hash(self, real: Path, sha256: str, size: int) -> str:
        """The file's xet hash, building its chunks and xorbs the first time (blocking: call
        from a thread)."""
        key = (sha256, size)
        found = self._memo.get(key)
        if found is not None:
            return found
        with self._guard:
            lock = self._locks.setdefault(f"{sha256}-{size}", threading.Lock())
        with lock:
            pointer = self.dir / "sha" / f"{sha256}-{size}"
            try:
                found = pointer.read_text().strip()
            except OSError:
                found = None
            if found is None or self.load(found) is None:
                found = self._build(real, size)
                _write_atomic(pointer, found.encode())
            self._memo[key] = found
            return found

    def load(self, xet_hash: str) -> XetFile | None:
        """The file named ``xet_hash`` as built here, or None (blocking: call from a thread)."""
        with self._guard:
            cached = self._files.get(xet_hash)
            if cached is not None:
                self._files.move_to_end(xet_hash)
                return cached
        if len(xet_hash) != 64 or any(c not in "0123456789abcdef" for c in xet_hash):
            return None
        try:
            raw = json.loads((self.dir / "files" / f"{xet_hash}.json").read_text())
        except (OSError, ValueError):
            return None
        leaves = [(hashing.from_hex(h), s) for h, s in raw["chunks"]]
        spans = [XorbSpan(x["hash"], x["first"], x["offsets"]) for x in raw["xorbs"]]
        starts = [0]
        for _, s in leaves:
            starts.append(starts[-1] + s)
        found = XetFile(xet_hash, raw["size"], leaves, starts, spans)
        with self._guard:
            self._files[xet_hash] = found
            while len(self._files) > _KEEP:
                self._files.popitem(last=False)
        return found

    def _build(self, real: Path, size: int) -> str:
        packer = _Packer(self)
        pending = b""
        with open(real, "rb") as fh:
            while True:
                block = fh.read(_READ)
                buf = pending + block
                if not buf:
                    break
                ends = chunking.cut_points(buf)
                if block:  # the last cut of a block is where the data stopped, not a cut
                    ends = ends[:-1]
                view, start = memoryview(buf), 0
                for end in ends:
                    packer.add(view[start:end])
                    start = end
                pending = buf[start:]
                if not block:
                    break
        packer.flush()
        leaves = packer.leaves
        if sum(s for _, s in leaves) != size:
            raise OSError(f"{real} changed while its xorbs were built: ask again")
        name = hashing.to_hex(hashing.file_hash(leaves))
        index = {"version": 1, "size": size,
                 "chunks": [[hashing.to_hex(h), s] for h, s in leaves],
                 "xorbs": [{"hash": x.hash, "first": x.first, "offsets": x.offsets}
                           for x in packer.spans]}
        _write_atomic(self.dir / "files" / f"{name}.json", json.dumps(index).encode())
        log.info("xet built file=%s size=%d chunks=%d xorbs=%d xet_hash=%s", real.name, size,
                 len(leaves), len(packer.spans), name)
        return name
