"""fsck: bit rot, truncation, missing blobs, unreadable blobs, --repair, --incremental."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from cachecd import errors
from cachecd.store.fsck import EXIT_CORRUPT, EXIT_UNVERIFIABLE, fsck
from cachecd.store.store import Store


def blob(i: int, size: int = 2048) -> tuple[str, bytes]:
    data = random.Random(i).randbytes(size)
    return xxhash.xxh3_128(data).hexdigest(), data


def seed(root: Path, n: int) -> list[str]:
    async def go() -> list[str]:
        store = await Store.open([root])
        out = []
        for i in range(n):
            digest, data = blob(i)
            await store.commit(digest, data, await store.reserve(len(data)))
            out.append(digest)
        await store.close()
        return out

    return sorted(asyncio.run(go()))


def path_of(root: Path, digest: str) -> Path:
    return root / "blobs" / digest[:2] / digest


def flip_byte(path: Path, offset: int = 100) -> None:
    with open(path, "r+b") as f:  # what `dd conv=notrunc` does
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_clean(tmp_path: Path) -> None:
    seed(tmp_path, 4)
    seen: list[tuple[int, int]] = []
    report = fsck([tmp_path], progress=lambda done, total: seen.append((done, total)))
    assert report.exit_code == 0 and report.checked == report.ok == 4 and report.complete
    assert seen[-1] == (4, 4) and report.bytes_checked == 4 * 2048


def test_bit_rot_truncation_and_missing(tmp_path: Path) -> None:
    digests = seed(tmp_path, 6)
    flip_byte(path_of(tmp_path, digests[0]))
    os.truncate(path_of(tmp_path, digests[1]), 1000)
    path_of(tmp_path, digests[2]).unlink()
    report = fsck([tmp_path])
    assert report.exit_code == EXIT_CORRUPT
    kinds = {i.digest: i.kind for i in report.corrupt}
    assert kinds == {digests[0]: "corrupt", digests[1]: "wrong_size", digests[2]: "missing"}
    fast = fsck([tmp_path], fast=True)  # sizes only: the flipped byte goes unseen
    assert {i.digest for i in fast.corrupt} == {digests[1], digests[2]}
    assert fast.exit_code == EXIT_CORRUPT


def test_repair_quarantines_and_drops_rows_then_refetch_works(tmp_path: Path) -> None:
    digests = seed(tmp_path, 4)
    flip_byte(path_of(tmp_path, digests[0]))
    path_of(tmp_path, digests[1]).unlink()
    repaired = fsck([tmp_path], repair=True)
    assert repaired.exit_code == EXIT_CORRUPT  # it reports what it found...
    assert all(i.repaired for i in repaired.corrupt)
    assert fsck([tmp_path]).exit_code == 0  # ...and leaves a clean cache
    assert len(list((tmp_path / "quarantine").iterdir())) == 1

    async def refetch() -> None:
        store = await Store.open([tmp_path])
        assert not store.has(digests[0]) and store.has(digests[2])
        i = next(i for i in range(4) if blob(i)[0] == digests[0])
        data = blob(i)[1]
        await store.commit(digests[0], data, await store.reserve(len(data)))
        await store.close()

    asyncio.run(refetch())
    assert fsck([tmp_path]).exit_code == 0


def test_symlink_at_blob_path_is_corrupt(tmp_path: Path) -> None:
    digests = seed(tmp_path, 1)
    path = path_of(tmp_path, digests[0])
    elsewhere = tmp_path / "elsewhere"
    os.rename(path, elsewhere)
    path.symlink_to(elsewhere)
    report = fsck([tmp_path], repair=True)
    assert [i.kind for i in report.corrupt] == ["not_a_file"]
    assert elsewhere.exists() and not path.is_symlink()


def test_strays_and_temps_reported_not_corrupt(tmp_path: Path) -> None:
    seed(tmp_path, 2)
    digest, data = blob(50)
    path_of(tmp_path, digest).parent.mkdir(exist_ok=True)
    path_of(tmp_path, digest).write_bytes(data)
    (tmp_path / "tmp" / "x.1.2").write_bytes(b"partial")
    report = fsck([tmp_path])
    assert report.exit_code == 0 and report.strays == 1 and report.temps == 1
    fixed = fsck([tmp_path], repair=True)
    assert fixed.strays_adopted == 1 and list((tmp_path / "tmp").iterdir()) == []
    after = fsck([tmp_path])
    assert after.checked == 3 and after.strays == 0


def test_incremental_resumes_from_checkpoint(tmp_path: Path) -> None:
    digests = seed(tmp_path, 20)
    flip_byte(path_of(tmp_path, digests[10]))
    first = fsck([tmp_path], limit=7)
    assert first.checked == 7 and not first.complete and first.exit_code == 0
    second = fsck([tmp_path], incremental=True, limit=7)
    assert second.resumed_from == digests[6] and second.checked == 7
    assert [i.digest for i in second.corrupt] == [digests[10]]
    third = fsck([tmp_path], incremental=True)
    assert third.resumed_from == digests[13] and third.checked == 6 and third.complete
    fresh = fsck([tmp_path], incremental=True)  # the pass finished: a new one starts
    assert fresh.resumed_from is None and fresh.checked == 20
    assert fsck([tmp_path], limit=5).resumed_from is None  # without --incremental: from 0


def test_refuses_while_the_daemon_holds_the_lock(tmp_path: Path) -> None:
    seed(tmp_path, 1)

    async def go() -> None:
        store = await Store.open([tmp_path])
        try:
            with pytest.raises(errors.CacheLocked):
                fsck([tmp_path])
        finally:
            await store.close()

    asyncio.run(go())


_UNPRIVILEGED = """
import json, sys
from pathlib import Path
from cachecd.store.fsck import fsck
r = fsck([Path(sys.argv[1])])
print(json.dumps({"exit": r.exit_code, "unverifiable": [i.digest for i in r.unverifiable],
                  "corrupt": [i.digest for i in r.corrupt]}))
"""


def test_unreadable_blob_is_unverifiable(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to drop CAP_DAC_OVERRIDE for an unreadable file")
    digests = seed(tmp_path, 3)
    path_of(tmp_path, digests[0]).chmod(0)
    flip_byte(path_of(tmp_path, digests[1]))
    drop = "-dac_override,-dac_read_search"
    proc = subprocess.run(
        ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}",
         sys.executable, "-c", _UNPRIVILEGED, str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    if proc.returncode != 0 and "setpriv" in proc.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here: {proc.stderr.strip()}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "exit": EXIT_CORRUPT | EXIT_UNVERIFIABLE,
        "unverifiable": [digests[0]],
        "corrupt": [digests[1]],
    }
