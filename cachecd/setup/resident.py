"""The resident model on disk: the non-expert tensors the model loads, by exact ranges, in one file.

Most shards of a streamed model also hold experts, so whole shards are never downloaded: each
resident tensor's bytes are fetched by range, verified against the manifest's xxh3-128, and
written at their place in ``model-resident.safetensors`` (mlx-lm's loader globs
``model*.safetensors``). Only the tensors named in ``keep`` are installed (``setup --stream``
passes what mlx-lm's model keeps after its sanitize: a multimodal repo's vision weights are not).
Invariants: the final file appears (atomic rename) only when every tensor in it verified; an
interrupted run leaves ``.partial`` plus a progress file listing the tensors already written and
verified, so the next run resumes instead of starting over. With ``reuse`` (another revision's
resident file), a tensor whose bytes there hash to this manifest's xxh3-128 is copied from it,
not fetched: a new revision downloads only the tensors that changed.

With a manifest made from headers (``Manifest.learns``: setup with no manifest), no tensor's
digest is known beforehand: ``fetch`` must hand on only bytes proven through Xet against the
Hub's hash of the shard, and each tensor's xxh3-128 is learnt from them and recorded beside the
file (``.proven``, with the progress while it runs). A re-run hashes the installed file against
that record and fetches again, proven, every tensor that does not match or was never proven (a
file an earlier manifest's word installed): an install holds no byte the Hub did not vouch for.

An install is as private as the expert cache (blobs 0600 in 0700 directories): ``make_private``
leaves every directory of a model's installs 0700 and every file 0600, the resident file is
created 0600, and a rerun of setup fixes an install an older cachecd left readable by all.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from cachecd.durable import full_fsync, sync_dir
from cachecd.errors import ChecksumMismatch, ManifestInvalid
from cachecd.manifest import bounds
from cachecd.manifest.safetensors_header import MAX_HEADER_BYTES
from cachecd.upstream.verify import digest

RESIDENT_FILE = "model-resident.safetensors"
_GROUP_BYTES = 64 << 20
PROVEN_GAP = 512 << 10  # what a proof's window adds to a range, about (docs/streaming.md)


def safetensors_header(tensors: list[Any], metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """The header block (length prefix + JSON padded to 8 bytes) and each tensor's file offset."""
    entries: dict[str, Any] = {"__metadata__": metadata}
    offsets, pos = [], 0
    for t in tensors:
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        offsets.append(pos)
        pos += t.nbytes
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    head = struct.pack("<Q", len(body)) + body
    return head, [len(head) + o for o in offsets]


def make_private(models_dir: Path, repo: str) -> Path:
    """Every directory of ``repo``'s installs under ``models_dir`` 0700 and every file 0600
    (created 0700 where missing, the models dir too); returns the repo's folder. Nothing else
    is changed: an existing models dir keeps its mode (it also holds manifests, which are
    public)."""
    models_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    top = models_dir / repo.split("/")[0]
    folder = models_dir / repo
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(top, 0o700)
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o700)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o600)
    return folder


def plan_groups(tensors: list[Any], gap: int = 0) -> list[list[int]]:
    """Indices of tensors grouped into one Range request each: same file, at most ``gap`` bytes
    apart (back to back by default), bounded. Proven reads merge across gaps up to about what a
    proof's window widens a range by anyway, so no chunk between two tensors is read twice."""
    order = sorted(range(len(tensors)), key=lambda i: (tensors[i].file, tensors[i].offset))
    groups: list[list[int]] = []
    for i in order:
        t = tensors[i]
        if groups:
            last = tensors[groups[-1][-1]]
            size = last.offset + last.nbytes - tensors[groups[-1][0]].offset
            if (last.file == t.file and 0 <= t.offset - last.offset - last.nbytes <= gap
                    and size < _GROUP_BYTES):
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def skipped_summary(skipped: Iterable[str], kept: Iterable[str], most: int = 4) -> str:
    """The skipped tensors as the subtrees they fill, with counts: ``vision_tower (412), ...``
    (each name's shortest dotted prefix under which nothing is kept)."""
    taken = {".".join(parts[:i]) for parts in (k.split(".") for k in kept)
             for i in range(1, len(parts) + 1)}
    groups: Counter[str] = Counter()
    for name in skipped:
        parts = name.split(".")
        groups[next((".".join(parts[:i]) for i in range(1, len(parts) + 1)
                     if ".".join(parts[:i]) not in taken), name)] += 1
    shown = [f"{g} ({n})" for g, n in groups.most_common(most)]
    more = len(groups) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


class ResidentWriter:
    def __init__(self, manifest: Any, out_dir: Path, keep: Collection[str] | None = None,
                 proven: bool = False) -> None:
        self.manifest = manifest
        self.final = out_dir / RESIDENT_FILE
        self.partial = out_dir / (RESIDENT_FILE + ".partial")
        self.progress = out_dir / (RESIDENT_FILE + ".progress")
        self.tensors = [t for t in manifest.resident if keep is None or t.name in keep]
        meta = {"format": "mlx", "cachecd_repo": manifest.repo, "cachecd_revision": manifest.revision}
        self.header, self.offsets = safetensors_header(self.tensors, meta)
        # ``proven``: the shards are in Xet, so every tensor is taken from proven bytes and a
        # manifest's digests are only compared with them (``disagree``), never obeyed.
        self.learns: bool = bool(getattr(manifest, "learns", False)) or proven
        self.disagree: list[str] = []  # tensors whose proven bytes the manifest misnames
        self.proven_path = out_dir / (RESIDENT_FILE + ".proven")
        self.learnt: dict[str, str] = {}  # tensor name -> xxh3-128 hex of its proven bytes
        self.repaired: list[str] = []  # tensors an installed file held that did not match

    def done(self) -> bool:
        if not (self.final.exists() and self.final.stat().st_size == self._size()):
            return False
        return not self.learns or not self._unproven()

    def _record(self) -> dict[str, str]:
        try:
            state = json.loads(self.proven_path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        if state.get("revision") != self.manifest.revision:
            return {}
        return dict(state.get("tensors") or {})

    def _unproven(self) -> list[int]:
        """The tensors of the installed file whose bytes do not hash to the digest learnt from
        proven bytes (every one, where nothing was recorded)."""
        record, bad = self._record(), []
        with open(self.final, "rb") as f:
            for i, t in enumerate(self.tensors):
                want = record.get(t.name)
                if want is None or digest(os.pread(f.fileno(), t.nbytes, self.offsets[i])).hex() != want:
                    bad.append(i)
                else:
                    self.learnt[t.name] = want
        return bad

    def _reopen(self) -> None:
        """An installed file that does not match its proven record becomes the partial file, its
        matching tensors done: the run fetches the others again, proven."""
        bad = self._unproven()
        self.repaired = [self.tensors[i].name for i in bad]
        good = [t.name for i, t in enumerate(self.tensors) if i not in set(bad)]
        os.replace(self.final, self.partial)
        self._save_progress(set(good))

    def _size(self) -> int:
        return len(self.header) + self.nbytes

    @property
    def nbytes(self) -> int:
        """The tensors' bytes: what a run fetches when nothing is installed yet."""
        return sum(t.nbytes for t in self.tensors)

    def _load_progress(self) -> set[str]:
        try:
            state = json.loads(self.progress.read_text())
        except (OSError, json.JSONDecodeError):
            return set()
        if state.get("revision") != self.manifest.revision or not self.partial.exists():
            return set()
        done = set(state.get("done", []))
        if self.learns:  # a tensor is done only with the digest its proven bytes gave
            self.learnt.update({k: v for k, v in (state.get("tensors") or {}).items() if k in done})
            done &= set(self.learnt)
        return done

    def _save_progress(self, done: set[str]) -> None:
        self._save_learnt(self.progress, {"done": sorted(done)})

    def _save_learnt(self, path: Path, extra: dict[str, Any]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"revision": self.manifest.revision, **extra,
                                   "tensors": dict(sorted(self.learnt.items()))}))
        os.replace(tmp, path)

    async def run(self, fetch: Callable[[str, int, int], Any], progress: Callable[[int], None],
                  parallel: int = 4, reuse: Path | None = None) -> int:
        """Fetch what is missing; returns bytes fetched. ``fetch(file, start, end)`` -> bytes;
        ``reuse``: a resident file to copy unchanged tensors from first."""
        if self.done():
            return 0
        if self.learns and self.final.exists() and self.final.stat().st_size == self._size():
            self._reopen()
        done = self._load_progress()
        fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a .partial an older cachecd left 0644
            os.ftruncate(fd, self._size())
            os.pwrite(fd, self.header, 0)
            if reuse is not None and not self.learns:  # no digest to reuse by: all proven
                await asyncio.to_thread(self._copy_unchanged, fd, done, reuse)
            fetched = await self._fetch_all(fd, done, fetch, progress, parallel)
            await asyncio.to_thread(full_fsync, fd)
        finally:
            os.close(fd)
        if self.learns:  # before the file it vouches for is final
            self._save_learnt(self.proven_path, {})
        os.replace(self.partial, self.final)
        sync_dir(self.final.parent)  # the rename itself survives a power loss
        self.progress.unlink(missing_ok=True)
        return fetched

    async def _fetch_all(self, fd: int, done: set[str], fetch: Callable[[str, int, int], Any],
                         progress: Callable[[int], None], parallel: int) -> int:
        slots = asyncio.Semaphore(parallel)
        fetched = 0

        async def one(group: list[int]) -> None:
            nonlocal fetched
            todo = [i for i in group if self.tensors[i].name not in done]
            progress(sum(self.tensors[i].nbytes for i in group if i not in todo))
            if not todo:
                return
            # The group is back to back, so the span from the first to the last undone tensor is
            # one range; tensors inside it that were already written are simply written again.
            todo = group[group.index(todo[0]):group.index(todo[-1]) + 1]
            first, last = self.tensors[todo[0]], self.tensors[todo[-1]]
            async with slots:
                data = await fetch(first.file, first.offset, last.offset + last.nbytes)
            await asyncio.to_thread(self._write_verified, fd, todo, memoryview(data), first.offset)
            progress(sum(self.tensors[i].nbytes for i in todo if self.tensors[i].name not in done))
            done.update(self.tensors[i].name for i in todo)
            fetched += len(data)
            self._save_progress(done)

        gap = PROVEN_GAP if self.learns else 0
        await asyncio.gather(*(one(g) for g in plan_groups(self.tensors, gap)))
        return fetched

    def _copy_unchanged(self, fd: int, done: set[str], old: Path) -> None:
        """Copy the tensors ``old`` holds with the bytes this manifest names (each hashed again)."""
        try:
            with open(old, "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                header = bounds.loads(f.read(min(size, MAX_HEADER_BYTES)), str(old),
                                      "safetensors header", MAX_HEADER_BYTES)
                for i, t in enumerate(self.tensors):
                    entry = header.get(t.name)
                    if t.name in done or not isinstance(entry, dict):
                        continue
                    start, end = entry["data_offsets"]
                    if end - start != t.nbytes:
                        continue
                    data = os.pread(f.fileno(), t.nbytes, 8 + size + start)
                    if digest(data) == t.xxh3:
                        os.pwrite(fd, data, self.offsets[i])
                        done.add(t.name)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error,
                ManifestInvalid):
            pass  # an unreadable old install: what was not copied is fetched
        full_fsync(fd)  # before the progress record names these tensors done
        self._save_progress(done)

    def _write_verified(self, fd: int, todo: list[int], data: memoryview, base: int) -> None:
        for i in todo:
            t = self.tensors[i]
            piece = data[t.offset - base:t.offset - base + t.nbytes]
            if self.learns:  # ``fetch`` handed on only proven bytes: their digest is learnt
                got = digest(piece)
                self.learnt[t.name] = got.hex()
                if not getattr(self.manifest, "learns", False) and got != t.xxh3:
                    self.disagree.append(t.name)
            elif digest(piece) != t.xxh3:
                raise ChecksumMismatch(f"resident tensor {t.name} from {t.file} does not match the manifest")
            os.pwrite(fd, piece, self.offsets[i])
        full_fsync(fd)  # before the progress record names these tensors done

