"""Recovery at open: temps, missing/short rows, strays, duplicates; real files and LMDB."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import xxhash

from cachecd.store.blobs import BlobDirs
from cachecd.store.index import INDEX_DIRNAME, Entry, Index
from cachecd.store.recovery import recover


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


_WRITER = """
import asyncio, random, sys
from pathlib import Path
import xxhash
from cachecd.store.store import Store
async def main():
    store = await Store.open([Path(sys.argv[1])], budget=32 * 1024)
    print("ready", flush=True)
    rng = random.Random(int(sys.argv[2]))
    while True:
        data = rng.randbytes(rng.randint(1, 8192))
        digest = xxhash.xxh3_128(data).hexdigest()
        await store.commit(digest, data, await store.reserve(len(data)))
        store.touch(digest)
asyncio.run(main())
"""


def test_random_kills_while_writing_and_evicting(tmp_path: Path) -> None:
    """kill -9 at random moments of a write+evict loop; every reopen is consistent."""
    import asyncio
    import signal
    import subprocess
    import sys

    from cachecd.store.fsck import fsck
    from cachecd.store.store import Store

    rng = random.Random(11)
    for round_ in range(5):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(round_)], stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.5))
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -9

        async def reopen() -> None:
            store = await Store.open([tmp_path], budget=32 * 1024)
            st = store.stats()
            assert store.recovery.full_scan and st["bytes"] <= 32 * 1024
            assert list((tmp_path / "tmp").iterdir()) == []
            await store.close()

        asyncio.run(reopen())
        report = fsck([tmp_path])
        assert report.exit_code == 0 and report.strays == 0, report.summary()


_ONE_COMMIT = """
import asyncio, sys
from pathlib import Path
from cachecd.store.store import Store
async def main():
    store = await Store.open([Path(sys.argv[1])])
    data = b"x" * 65536
    await store.commit(sys.argv[2], data, await store.reserve(len(data)))
    await store.close()
asyncio.run(main())
"""


def test_write_order_under_strace(tmp_path: Path) -> None:
    """fsync(tmp) < rename < fsync(dir) < the LMDB commit's writes (RELIABILITY scenario 1)."""
    import re
    import shutil
    import subprocess
    import sys

    if shutil.which("strace") is None:
        import pytest

        pytest.skip("strace is not installed")
    digest = xxhash.xxh3_128(b"x" * 65536).hexdigest()
    trace = tmp_path / "trace"
    root = tmp_path / "cache"
    proc = subprocess.run(
        ["strace", "-f", "-qq", "-o", str(trace), "-e",
         "trace=openat,fsync,fdatasync,rename,renameat,renameat2,pwrite64",
         sys.executable, "-c", _ONE_COMMIT, str(root), digest],
        capture_output=True, text=True, timeout=120, check=False,
    )
    if proc.returncode != 0 and "ptrace" in proc.stderr:
        import pytest

        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = trace.read_text().splitlines()
    fd_kind: dict[str, str | None] = {}  # fd -> what it was last opened on (fds get reused)
    events: list[str] = []
    for line in lines:
        m = re.search(r'openat\(AT_FDCWD, "([^"]+)", ([^)]*)\) = (\d+)', line)
        if m:
            path = m.group(1)
            fd_kind[m.group(3)] = (
                "tmp" if "/tmp/" + digest in path
                else "dir" if path.endswith("/blobs/" + digest[:2])
                else "mdb" if path.endswith("data.mdb")
                else None
            )
            continue
        m = re.search(r"\b(fsync|fdatasync|pwrite64)\((\d+)", line)
        if m:
            kind = fd_kind.get(m.group(2))
            if kind:
                events.append(f"{m.group(1)}:{kind}")
        elif re.search(r"\brename(at2?)?\(.*" + digest, line):
            events.append("rename")
    want = ["fsync:tmp", "rename", "fsync:dir"]
    positions = [events.index(w) for w in want]
    assert positions == sorted(positions), events
    after_dir = events[positions[-1] + 1:]
    assert any(e.endswith(":mdb") for e in after_dir), events  # the row is written after
    assert not any(e.endswith(":mdb") for e in events[positions[0]:positions[-1]]), events
