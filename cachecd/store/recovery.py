"""Recovery at open, before the store serves anything: make the index and the files agree.

After it returns:
- tmp/ of every cache dir is empty (leftovers of writes a crash interrupted);
- every index row names a regular file of exactly the recorded size (rows whose blob is missing
  are dropped; a blob of the wrong size is quarantined and its row dropped);
- every file under blobs/ has a row: a stray (renamed into place but never committed, the
  after_rename crash window) is hashed and adopted if its xxh3-128 equals its name, otherwise
  moved to quarantine/; a second copy of an indexed blob in another dir is removed.

Contents of indexed blobs are not re-hashed here (that is fsck's job and would make startup
O(cache size)); the daemon's verified reads catch bit rot. Evicting down to the budget is done
by the store right after, because it needs the policy.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from cachecd import errors
from cachecd.store import blobs as blobs_mod
from cachecd.store.blobs import BlobDirs, OnDisk
from cachecd.store.crash import crash_point
from cachecd.store.index import Entry, Index

log = logging.getLogger(__name__)

CLEAN_KEY = b"clean_shutdown"


@dataclass
class RecoveryReport:
    temps_removed: int = 0
    rows_dropped: int = 0
    wrong_size_quarantined: int = 0
    duplicates_removed: int = 0
    strays_adopted: int = 0
    strays_quarantined: int = 0
    evicted: int = 0
    bytes_evicted: int = 0
    entries: int = 0
    bytes: int = 0
    full_scan: bool = True
    dropped: list[str] = field(default_factory=list)

    def log_line(self) -> str:
        return (
            f"event=recovery full_scan={self.full_scan} entries={self.entries} "
            f"bytes={self.bytes} "
            f"temps_removed={self.temps_removed} rows_dropped={self.rows_dropped} "
            f"wrong_size_quarantined={self.wrong_size_quarantined} "
            f"duplicates_removed={self.duplicates_removed} strays_adopted={self.strays_adopted} "
            f"strays_quarantined={self.strays_quarantined} evicted={self.evicted} "
            f"bytes_evicted={self.bytes_evicted}"
        )


def mark_clean(index: Index) -> None:
    """The last write of an orderly close: the next open may skip the full scan."""
    index.put_meta(CLEAN_KEY, b"1").result()


def recover(
    blobs: BlobDirs, index: Index, *, full: bool | None = None
) -> tuple[RecoveryReport, dict[str, Entry]]:
    """Blocking; run it in a thread. Returns the report and the entries that survived.

    ``full=None``: scan every file only if the last run did not close cleanly (a crash); after
    a clean close the rows and files already agree, and a short or missing blob is still
    caught when it is opened (size check) or by fsck.
    """
    report = RecoveryReport()
    for d in blobs.dirs:
        report.temps_removed += d.clear_tmp()
    clean = index.get_meta(CLEAN_KEY) is not None
    if clean:
        try:
            index.put_meta(CLEAN_KEY, None).result()
        except errors.CachecdError as exc:  # a full disk: a later crash would skip a scan
            log.warning("event=clean_flag_clear_failed err=%s", exc)
    entries = index.load_entries()
    report.full_scan = full if full is not None else not clean
    if report.full_scan:
        _reconcile(blobs, index, entries, report)
    report.entries = len(entries)
    report.bytes = sum(e.size for e in entries.values())
    crash_point("during_recovery")  # the scan done; nothing served yet
    return report, entries


def _reconcile(
    blobs: BlobDirs, index: Index, entries: dict[str, Entry], report: RecoveryReport
) -> None:
    on_disk = scan_blobs(blobs)
    puts, drops = _check_rows(blobs, entries, on_disk, report)
    for found in on_disk.values():
        for item in found:
            adopted = handle_stray(blobs, item, entries, report)
            if adopted is not None:
                entries[item.name] = adopted
                puts[item.name] = adopted
    _apply(index, puts, drops)
    report.dropped = drops


def scan_blobs(blobs: BlobDirs) -> dict[str, list[OnDisk]]:
    out: dict[str, list[OnDisk]] = {}
    for d in blobs.dirs:
        for item in d.iter_blobs():
            out.setdefault(item.name, []).append(item)
    return out


def _check_rows(
    blobs: BlobDirs, entries: dict[str, Entry], on_disk: dict[str, list[OnDisk]],
    report: RecoveryReport,
) -> tuple[dict[str, Entry], list[str]]:
    """Match rows to files; consumes matched files from ``on_disk``; drops bad rows."""
    puts: dict[str, Entry] = {}
    drops: list[str] = []
    for digest, entry in list(entries.items()):
        found = on_disk.get(digest, [])
        if len(found) == 1 and _fits(found[0], entry) and found[0].dir_index == entry.dir_index:
            del on_disk[digest]  # the common case, kept cheap: ~10^5 rows at K3 scale
            continue
        match = _pick(found, entry)
        if match is None:
            for item in found:
                if item.size != -1 and item.placed:
                    blobs.dirs[item.dir_index].move_to_quarantine(Path(item.path), "wrong_size")
                    report.wrong_size_quarantined += 1
                    found.remove(item)
                    break
            del entries[digest]
            drops.append(digest)
            report.rows_dropped += 1
            continue
        found.remove(match)
        if match.dir_index != entry.dir_index:
            entries[digest] = puts[digest] = Entry(match.dir_index, entry.size, entry.created)
    return puts, drops


def _fits(item: OnDisk, entry: Entry) -> bool:
    return item.size == entry.size and item.placed


def _pick(found: list[OnDisk], entry: Entry) -> OnDisk | None:
    good = [f for f in found if _fits(f, entry)]
    for f in good:
        if f.dir_index == entry.dir_index:
            return f
    return good[0] if good else None


def handle_stray(
    blobs: BlobDirs, item: OnDisk, entries: dict[str, Entry], report: RecoveryReport
) -> Entry | None:
    cdir = blobs.dirs[item.dir_index]
    valid = item.size >= 0 and item.placed and _is_digest(item.name)
    if valid and item.name in entries:
        os.unlink(item.path)  # the same content is indexed in another dir
        report.duplicates_removed += 1
        return None
    if valid and _hash_matches(item):
        report.strays_adopted += 1
        log.info("event=stray_adopted path=%s size=%d", item.path, item.size)
        return Entry(item.dir_index, item.size, time.time())
    cdir.move_to_quarantine(Path(item.path), "stray_bad" if valid else "stray_unknown")
    report.strays_quarantined += 1
    return None


def _is_digest(name: str) -> bool:
    try:
        blobs_mod.validate_digest(name)
        return True
    except errors.InvalidRequest:
        return False


def _hash_matches(item: OnDisk) -> bool:
    try:
        fd = os.open(item.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        digest, n = blobs_mod.hash_fd(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    return digest == item.name and n == item.size


def _apply(index: Index, puts: dict[str, Entry], drops: list[str]) -> None:
    if drops:
        index.delete_entries(drops).result()
    if puts:
        index.put_entries(puts).result()
