"""A build's work dir: one part per finished shard, so a build that stops resumes where it was.

A part is what one shard's pass found (``build_shard.ShardResult``): its sha256, header, tensor
and expert digests, and its bytes of experts split across shards. It is two files, each written
to a temp name, fsynced and renamed (``cachecd.durable`` via ``write_atomic``): ``<id>.pieces``
first, then ``<id>.json``, whose presence alone marks the shard done. A part is reused only when
its repo, commit, file name, size and sha256 all equal what the source lists now, and the source
vouches for that sha256 (the Hub does; a local folder does not, so a folder build starts over).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

from cachecd import constants
from cachecd.durable import write_atomic
from cachecd.manifest.build_plan import SourceFile
from cachecd.manifest.build_shard import ShardResult

log = logging.getLogger(__name__)

PART_FORMAT = "cachecd-manifest-part"
PART_VERSION = 1
CRASH_POINT = "manifest_part"  # CACHECD_CRASH_AT=manifest_part:N kills the build after N parts


class PartStore:
    def __init__(self, root: Path, repo: str, revision: str, *, durable: bool = True) -> None:
        self.root, self.repo, self.revision, self.durable = Path(root), repo, revision, durable
        self.root.mkdir(parents=True, exist_ok=True)
        self._saved = 0
        self._lock = threading.Lock()

    def _stem(self, name: str) -> Path:
        return self.root / hashlib.sha256(name.encode()).hexdigest()[:24]

    def load(self, f: SourceFile) -> ShardResult | None:
        """The finished part of ``f`` if there is one for exactly this file; None otherwise."""
        stem = self._stem(f.name)
        try:
            part = json.loads(stem.with_suffix(".json").read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("part_ignored file=%s reason=%s", f.name, exc)
            return None
        why = self._mismatch(part, f, stem.with_suffix(".pieces"))
        if why:
            log.info("part_ignored file=%s reason=%s", f.name, why)
            return None
        t = bytes.fromhex(part["tensors"])
        return ShardResult(
            f.name, f.size, part["sha256"], base64.b64decode(part["header"]),
            [t[i : i + 16] for i in range(0, len(t), 16)],
            {(x[0], x[1]): bytes.fromhex(x[2]) for x in part["experts"]},
            {(x[0], x[1]): (x[2], x[3]) for x in part["pieces"]},
        )

    def _mismatch(self, part: Any, f: SourceFile, pieces: Path) -> str:
        want = {"format": PART_FORMAT, "version": PART_VERSION, "repo": self.repo,
                "revision": self.revision, "file": f.name, "size": f.size}
        if not isinstance(part, dict):
            return "not a part"
        for key, value in want.items():
            if part.get(key) != value:
                return f"{key} is {part.get(key)!r:.80}, not {value!r:.80}"
        if f.sha256 is None or part.get("sha256") != f.sha256:
            return "the source vouches for no sha256 or another one"
        try:
            size = pieces.stat().st_size
        except OSError as exc:
            return f"pieces: {exc}"
        return "" if size == part.get("pieces_bytes") else "pieces: wrong size"

    def save(self, r: ShardResult) -> ShardResult:
        """Make ``r`` durable; returns it without its piece bytes (read back with ``piece``)."""
        stem = self._stem(r.file)
        part = {
            "format": PART_FORMAT, "version": PART_VERSION, "repo": self.repo,
            "revision": self.revision, "file": r.file, "size": r.size, "sha256": r.sha256,
            "header": base64.b64encode(r.header).decode(), "tensors": b"".join(r.tensors).hex(),
            "experts": [[k[0], k[1], d.hex()] for k, d in r.experts.items()],
            "pieces": [[k[0], k[1], off, n] for k, (off, n) in r.pieces.items()],
            "pieces_bytes": len(r.piece_bytes),
        }
        self._write(stem.with_suffix(".pieces"), r.piece_bytes)
        self._write(stem.with_suffix(".json"), json.dumps(part, separators=(",", ":")).encode())
        with self._lock:
            self._saved += 1
            saved = self._saved
        if constants.CRASH_AT == f"{CRASH_POINT}:{saved}":  # test knob, as store.crash's points
            os.kill(os.getpid(), signal.SIGKILL)
        return ShardResult(r.file, r.size, r.sha256, r.header, r.tensors, r.experts, r.pieces)

    def _write(self, path: Path, data: bytes) -> None:
        if self.durable:
            write_atomic(path, data)
        else:  # a throwaway work dir: nothing to survive a crash for
            path.write_bytes(data)

    def piece(self, r: ShardResult, span: tuple[int, int]) -> bytes:
        with open(self._stem(r.file).with_suffix(".pieces"), "rb") as fh:
            fh.seek(span[0])
            return fh.read(span[1])

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
