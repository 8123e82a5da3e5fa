"""Recovery at open: temps, missing/short rows, strays, duplicates; real files and LMDB."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import xxhash

from cachecd.blobs import BlobDirs
from cachecd.index import INDEX_DIRNAME, Entry, Index
from cachecd.recovery import recover


def blob(i: int, size: int = 512) -> tuple[str, bytes]:
    data = random.Random(i).randbytes(size)
    return xxhash.xxh3_128(data).hexdigest(), data


def seed(root: Path, n: int) -> list[str]:
    """n committed blobs, written the way the store writes them."""
    blobs = BlobDirs([root])
    idx = Index(root / INDEX_DIRNAME)
    out = []
    for i in range(n):
        digest, data = blob(i)
        d = blobs.write_blob(digest, data)
        idx.put_entry(digest, Entry(d, len(data), time.time())).result()
        out.append(digest)
    idx.close()
    blobs.release()
    return out


def run_recovery(roots: list[Path]):  # type: ignore[no-untyped-def]
    blobs = BlobDirs(roots)
    idx = Index(roots[0] / INDEX_DIRNAME)
    try:
        report, entries = recover(blobs, idx)
        return report, entries, idx.load_entries()
    finally:
        idx.close()
        blobs.release()


def test_clean_cache_is_left_alone(tmp_path: Path) -> None:
    digests = seed(tmp_path, 5)
    report, entries, stored = run_recovery([tmp_path])
    assert sorted(entries) == sorted(digests) == sorted(stored)
    assert (report.temps_removed, report.rows_dropped, report.strays_adopted) == (0, 0, 0)
    assert report.entries == 5 and report.bytes == 5 * 512


def test_temps_missing_short_and_strays(tmp_path: Path) -> None:
    digests = seed(tmp_path, 6)
    blob_dir = tmp_path / "blobs"
    (tmp_path / "tmp" / f"{digests[0]}.1.2").write_bytes(b"half a write")
    os.unlink(blob_dir / digests[1][:2] / digests[1])  # missing
    os.truncate(blob_dir / digests[2][:2] / digests[2], 100)  # short
    good_stray, data = blob(100)  # renamed but never indexed (the after_rename crash)
    (blob_dir / good_stray[:2]).mkdir(exist_ok=True)
    (blob_dir / good_stray[:2] / good_stray).write_bytes(data)
    bad_stray = blob(101)[0]  # right name, wrong bytes
    (blob_dir / bad_stray[:2]).mkdir(exist_ok=True)
    (blob_dir / bad_stray[:2] / bad_stray).write_bytes(b"rotten")
    (blob_dir / "junk.txt").write_bytes(b"?")  # not a digest at all
    misplaced = blob(102)  # valid bytes in the wrong XX subdir
    wrong_sub = "zz" if misplaced[0][:2] != "zz" else "yy"
    (blob_dir / wrong_sub).mkdir()
    (blob_dir / wrong_sub / misplaced[0]).write_bytes(misplaced[1])

    report, entries, stored = run_recovery([tmp_path])
    assert report.temps_removed == 1 and list((tmp_path / "tmp").iterdir()) == []
    assert report.rows_dropped == 2 and report.wrong_size_quarantined == 1
    assert report.strays_adopted == 1 and report.strays_quarantined == 3
    expect = {digests[0], *digests[3:], good_stray}
    assert set(entries) == set(stored) == expect
    assert stored[good_stray].size == len(data)
    assert len(list((tmp_path / "quarantine").iterdir())) == 4
    again, _, _ = run_recovery([tmp_path])  # idempotent
    assert (again.rows_dropped, again.strays_adopted, again.strays_quarantined) == (0, 0, 0)


def test_blob_moved_between_dirs_and_duplicates(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    BlobDirs([a, b]).release()
    digests = seed(a, 3)
    # Move one blob to the second dir (an admin rsync); copy another there too.
    moved, copied = digests[0], digests[1]
    (b / "blobs" / moved[:2]).mkdir(parents=True, exist_ok=True)
    os.rename(a / "blobs" / moved[:2] / moved, b / "blobs" / moved[:2] / moved)
    (b / "blobs" / copied[:2]).mkdir(parents=True, exist_ok=True)
    (b / "blobs" / copied[:2] / copied).write_bytes((a / "blobs" / copied[:2] / copied).read_bytes())

    report, entries, stored = run_recovery([a, b])
    assert report.rows_dropped == 0 and report.duplicates_removed == 1
    assert stored[moved].dir_index == 1 and entries[moved].dir_index == 1
    assert stored[copied].dir_index == 0
    assert not (b / "blobs" / copied[:2] / copied).exists()


def test_symlinked_blob_is_not_trusted(tmp_path: Path) -> None:
    digests = seed(tmp_path, 1)
    target = tmp_path / "elsewhere"
    path = tmp_path / "blobs" / digests[0][:2] / digests[0]
    target.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(target)
    report, entries, _ = run_recovery([tmp_path])
    assert entries == {} and report.rows_dropped == 1 and report.strays_quarantined == 1
    assert not path.is_symlink() and target.exists()
