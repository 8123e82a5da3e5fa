"""fsck: check that every indexed blob is present, of the right size and hashes to its name.

Runs while the daemon is NOT running: it takes the cache dirs' locks (a running daemon makes it
raise ``CacheLocked``) and opens the LMDB index itself.

Exit code bitmask (``FsckReport.exit_code``):
    0  clean
    1  corrupt: a blob whose bytes do not hash to its name, of the wrong size, or missing
    4  unverifiable: a blob it could not read (permissions, I/O error)

``fast`` checks sizes only. ``repair`` moves corrupt blobs to quarantine/ and drops their rows
(the daemon refetches on the next request); it also settles strays the way recovery does.
Progress is checkpointed in the index meta (the last digest checked, in key order) as it goes
and cleared when a pass completes; ``incremental`` resumes after that checkpoint, so a long
check can be split over several runs (``limit`` bounds one run).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cachecd.store.blobs import BlobDirs, hash_fd
from cachecd.store.index import INDEX_DIRNAME, Entry, Index
from cachecd.store.recovery import RecoveryReport, handle_stray, scan_blobs

log = logging.getLogger(__name__)

CHECKPOINT_KEY = b"fsck_checkpoint"
CHECKPOINT_EVERY_S = 2.0
EXIT_CORRUPT = 1
EXIT_UNVERIFIABLE = 4

Progress = Callable[[int, int], None]  # (checked so far, total this run)


@dataclass(frozen=True)
class FsckIssue:
    digest: str
    kind: str  # "corrupt" | "wrong_size" | "missing" | "not_a_file" | "unverifiable"
    detail: str
    repaired: bool = False


@dataclass
class FsckReport:
    checked: int = 0
    ok: int = 0
    bytes_checked: int = 0
    corrupt: list[FsckIssue] = field(default_factory=list)
    unverifiable: list[FsckIssue] = field(default_factory=list)
    strays: int = 0
    strays_adopted: int = 0
    strays_quarantined: int = 0
    temps: int = 0
    resumed_from: str | None = None
    complete: bool = False  # the pass reached the last entry (else: ``limit`` stopped it)

    @property
    def exit_code(self) -> int:
        return (EXIT_CORRUPT if self.corrupt else 0) | (
            EXIT_UNVERIFIABLE if self.unverifiable else 0
        )

    def summary(self) -> str:
        return (
            f"checked={self.checked} ok={self.ok} corrupt={len(self.corrupt)} "
            f"unverifiable={len(self.unverifiable)} strays={self.strays} temps={self.temps} "
            f"complete={self.complete} exit={self.exit_code}"
        )


def fsck(
    dirs: list[Path], fast: bool = False, repair: bool = False, incremental: bool = False,
    progress: Progress | None = None, *, limit: int | None = None, map_size: int | None = None,
) -> FsckReport:
    """Check the cache in ``dirs`` (blocking). Raises ``CacheLocked`` if a daemon holds it."""
    blobs = BlobDirs([Path(d) for d in dirs])
    try:
        index = Index(Path(dirs[0]) / INDEX_DIRNAME, map_size=map_size)
        try:
            report = FsckReport()
            _check_entries(blobs, index, report, fast, repair, incremental, progress, limit)
            _check_strays(blobs, index, report, repair)
        finally:
            index.close()
    finally:
        blobs.release()
    log.info("event=fsck %s", report.summary())
    return report


def _check_entries(
    blobs: BlobDirs, index: Index, report: FsckReport, fast: bool, repair: bool,
    incremental: bool, progress: Progress | None, limit: int | None,
) -> None:
    entries = index.load_entries()
    todo = sorted(entries)
    start = index.get_meta(CHECKPOINT_KEY) if incremental else None
    if start:
        report.resumed_from = start.decode()
        todo = [d for d in todo if d > report.resumed_from]
    if limit is not None:
        todo = todo[:limit]
    last_save = time.monotonic()
    for i, digest in enumerate(todo):
        issue = check_one(blobs, digest, entries[digest], fast)
        _record(blobs, index, report, digest, entries[digest], issue, repair)
        if progress is not None:
            progress(i + 1, len(todo))
        if time.monotonic() - last_save >= CHECKPOINT_EVERY_S:
            index.put_meta(CHECKPOINT_KEY, digest.encode()).result()
            last_save = time.monotonic()
    all_done = limit is None or not todo or todo[-1] == max(entries)
    report.complete = all_done
    if all_done:
        index.put_meta(CHECKPOINT_KEY, None).result()
    elif todo:
        index.put_meta(CHECKPOINT_KEY, todo[-1].encode()).result()


def check_one(blobs: BlobDirs, digest: str, entry: Entry, fast: bool) -> FsckIssue | None:
    """None if the blob is good; otherwise what is wrong with it."""
    try:
        fd, size = blobs.open_read(entry.dir_index, digest)
    except FileNotFoundError:
        return FsckIssue(digest, "missing", "the blob file is gone")
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink where a blob should be: never served
            return FsckIssue(digest, "not_a_file", "a symlink sits at the blob path")
        return FsckIssue(digest, "unverifiable", f"cannot open: {exc}")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return FsckIssue(digest, "not_a_file", "not a regular file")
        if size != entry.size:
            return FsckIssue(digest, "wrong_size", f"{size} bytes, expected {entry.size}")
        if fast:
            return None
        try:
            got, n = hash_fd(fd)
        except OSError as exc:
            return FsckIssue(digest, "unverifiable", f"cannot read: {exc}")
        if got != digest or n != entry.size:
            return FsckIssue(digest, "corrupt", f"bytes hash to {got}")
        return None
    finally:
        os.close(fd)


def _record(
    blobs: BlobDirs, index: Index, report: FsckReport, digest: str, entry: Entry,
    issue: FsckIssue | None, repair: bool,
) -> None:
    report.checked += 1
    if issue is None:
        report.ok += 1
        report.bytes_checked += entry.size
        return
    if issue.kind == "unverifiable":
        report.unverifiable.append(issue)
        log.warning("event=fsck_unverifiable digest=%s detail=%s", digest, issue.detail)
        return
    if repair:
        if issue.kind != "missing":
            blobs.quarantine(entry.dir_index, digest, f"fsck_{issue.kind}")
        index.delete_entries([digest]).result()
        issue = FsckIssue(digest, issue.kind, issue.detail, repaired=True)
    report.corrupt.append(issue)
    log.warning(
        "event=fsck_corrupt digest=%s kind=%s detail=%s repaired=%s",
        digest, issue.kind, issue.detail, issue.repaired,
    )


def _check_strays(blobs: BlobDirs, index: Index, report: FsckReport, repair: bool) -> None:
    """Files without rows and temp leftovers: not corruption (the next open settles them)."""
    entries = index.load_entries()
    for d in blobs.dirs:
        report.temps += sum(1 for _ in os.scandir(d.tmp))
        if repair:
            d.clear_tmp()
    found = scan_blobs(blobs)
    strays = [
        item for name, items in found.items() for item in items
        if name not in entries or entries[name].dir_index != item.dir_index
    ]
    report.strays = len(strays)
    if not repair:
        return
    rec = RecoveryReport()
    adopted: dict[str, Entry] = {}
    for item in strays:
        entry = handle_stray(blobs, item, entries, rec)
        if entry is not None:
            entries[item.name] = adopted[item.name] = entry
    if adopted:
        index.put_entries(adopted).result()
    report.strays_adopted, report.strays_quarantined = rec.strays_adopted, rec.strays_quarantined


__all__ = ["FsckIssue", "FsckReport", "check_one", "fsck"]
