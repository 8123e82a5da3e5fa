"""Scenario 10: bit rot, a short blob, a missing blob and stray files in a stopped cache.

``cachecd fsck`` (the real command) reports them with its exit bitmask (1 corrupt, 4
unverifiable), ``--fast`` sees sizes only, ``--repair`` quarantines and drops rows, and the
restarted daemon refetches good bytes. Without fsck, a running daemon's open drops a missing or
short blob and refetches it, and a blob the daemon did not commit itself is hashed on its first
open, so rot at rest (a flipped byte, same length) is quarantined and refetched; so is rot
that sets in while the daemon runs, at the blob's first open once its last hash is older than
REVERIFY_AFTER_S (shortened here). A byte flipped while the daemon already holds the blob is
NOT caught on the hit path (served without re-hashing, by design of the zero-copy path) until
then, a restart or fsck: the figure says so.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import xxhash

from tests.faults.figures import FIGURES
from tests.faults.support import FaultDaemon, Model, fetch_verified, fsck_cli
from tests.harness import run_cli


def _blob(d: FaultDaemon, model: Model, layer: int, expert: int) -> Path:
    digest = model.entry(layer, expert).digest_hex
    return d.cache_dir / "blobs" / digest[:2] / digest


def _flip(path: Path, offset: int) -> None:
    old = path.read_bytes()[offset]
    subprocess.run(["dd", f"of={path}", "bs=1", f"seek={offset}", "count=1", "conv=notrunc",
                    "status=none"], input=bytes([old ^ 0xFF]), check=True)


def _kinds(out: str) -> dict[str, str]:
    """digest -> issue kind, from fsck's listing lines."""
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and len(parts[1]) == 32:
            found[parts[1]] = parts[0]
    return found


def test_fsck_bitmask_fast_repair_then_refetch(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    d = pool.daemon(hub, [small])
    layer = small.layers[0]
    with d.client() as c:
        fetch_verified(c, small, layer, list(range(6)))
    assert d.stop() == 0
    rotten, short, gone = (_blob(d, small, layer, e) for e in (0, 1, 2))
    _flip(rotten, 100)
    os.truncate(short, short.stat().st_size // 2)
    gone.unlink()
    (d.cache_dir / "blobs" / "zz").mkdir()
    (d.cache_dir / "blobs" / "zz" / "stray-file").write_bytes(b"not a blob")
    name = xxhash.xxh3_128(b"other bytes").hexdigest()
    (d.cache_dir / "blobs" / name[:2]).mkdir(exist_ok=True)
    (d.cache_dir / "blobs" / name[:2] / name).write_bytes(b"a stray that hashes to its name? no")

    fast = fsck_cli(d.cache_dir, "--fast")
    assert fast.returncode == 1, fast.stdout + fast.stderr
    assert _kinds(fast.stdout) == {short.name: "wrong_size", gone.name: "missing"}
    full = fsck_cli(d.cache_dir)
    assert full.returncode == 1
    assert _kinds(full.stdout) == {rotten.name: "corrupt", short.name: "wrong_size",
                                   gone.name: "missing"}
    FIGURES.set("s10.fsck_exit_corrupt", full.returncode)
    FIGURES.set("s10.fsck_fast_misses_flipped_byte", rotten.name not in _kinds(fast.stdout))

    repair = fsck_cli(d.cache_dir, "--repair")
    assert repair.returncode == 1 and "(repaired)" in repair.stdout
    after = fsck_cli(d.cache_dir)
    assert after.returncode == 0, after.stdout
    quarantined = sorted(p.name.split(".")[0] for p in (d.cache_dir / "quarantine").iterdir())
    assert rotten.name in quarantined and short.name in quarantined
    FIGURES.set("s10.quarantined_by_repair", len(quarantined))
    hub.clear_records()
    d.start()
    with d.client() as c:
        fetch_verified(c, small, layer, list(range(6)))
    assert hub.count("cdn_get") == 3  # the three bad blobs were fetched again, the rest were hits
    FIGURES.set("s10.refetched_after_repair", hub.count("cdn_get"))


def test_fsck_as_another_uid_unreadable_blob_is_unverifiable(small: Model, pool, as_nobody) -> None:  # type: ignore[no-untyped-def]
    """fsck as uid 65534 on a cache it owns, with one blob it may not read: exit 4 (bit 4 only)."""
    hub = pool.hub(small)
    d = pool.daemon(hub, [small])
    layer = small.layers[0]
    with d.client() as c:
        fetch_verified(c, small, layer, list(range(4)))
    assert d.stop() == 0
    cache_dir, blob = d.cache_dir, _blob(d, small, layer, 3)
    # The probe: the same fsck run here first (exit 0), so the uid gets what hashing imports.
    nobody = as_nobody("-m", "cachecd.cli", "fsck", "--cache-dir", str(cache_dir))
    subprocess.run(["chown", "-R", f"{nobody.uid}:{nobody.uid}", str(cache_dir)], check=True)
    parent_mode = cache_dir.parent.stat().st_mode
    cache_dir.parent.chmod(0o711)  # let the uid reach its cache dir
    mode = blob.stat().st_mode
    blob.chmod(0)
    try:
        proc = subprocess.run(
            nobody.argv("-m", "cachecd.cli", "fsck", "--cache-dir", str(cache_dir)),
            capture_output=True, text=True, timeout=120, cwd="/", env=nobody.env(HOME="/tmp"))
    finally:
        cache_dir.parent.chmod(parent_mode & 0o7777)
        blob.chmod(mode & 0o7777)
        subprocess.run(["chown", "-R", "0:0", str(cache_dir)], check=True)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert _kinds(proc.stdout) == {blob.name: "unverifiable"}, proc.stdout
    FIGURES.set("s10.fsck_exit_unverifiable", proc.returncode)


def test_open_drops_missing_and_short_blobs_and_refetches(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    d = pool.daemon(hub, [small])
    layer = small.layers[1]
    with d.client() as c:
        fetch_verified(c, small, layer, [0, 1, 2])
        c.stats()  # answers once the commits are done: the blobs are in place
        _blob(d, small, layer, 0).unlink()
        short = _blob(d, small, layer, 1)
        os.truncate(short, 100)
        hub.clear_records()
        fetch_verified(c, small, layer, [0, 1, 2])
        assert hub.count("cdn_get") == 2
        # A flipped byte of the right size: served as it is on disk (the hit path does not
        # re-hash); only fsck finds it. Recorded, not counted as a served byte of this suite.
        rotten = _blob(d, small, layer, 2)
        _flip(rotten, 10)
        got = c.experts(small.repo, layer, [2])[0].tobytes()
        served_rot = xxhash.xxh3_128(got).digest() != small.entry(layer, 2).xxh3
    FIGURES.set("s10.open_refetched_missing_or_short", 2)
    FIGURES.set("s10.rotted_blob_served_on_hit_without_fsck", served_rot)
    assert d.stop() == 0
    assert fsck_cli(d.cache_dir, "--repair").returncode == 1  # fsck is what catches it


def test_rot_at_rest_is_caught_on_the_first_open_after_a_restart(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    d = pool.daemon(hub, [small])
    layer = small.layers[2]
    with d.client() as c:
        fetch_verified(c, small, layer, [3, 4])
    assert d.stop() == 0
    rotten = _blob(d, small, layer, 3)
    _flip(rotten, 50)  # same length: only a hash can tell
    hub.clear_records()
    d.start()
    with d.client() as c:
        fetch_verified(c, small, layer, [3, 4])  # the manifest's bytes, rotten blob or not
        store = c.stats()["store"]
    assert hub.count("cdn_get") == 1  # the rotten blob was fetched again, the good one was a hit
    assert (store["bit_rot_on_open"], store["verified_on_open"]) == (1, 1)
    assert any(p.name.startswith(rotten.name) for p in (d.cache_dir / "quarantine").iterdir())
    FIGURES.set("s10.rot_at_rest_caught_on_first_open", store["bit_rot_on_open"])
    out = run_cli("status", "--socket", str(d.socket)).stdout  # what the user sees
    assert "attention   1 cached experts failed their hash when opened" in out, out


def test_rot_while_running_is_caught_once_the_last_hash_is_old(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    d = pool.daemon(hub, [small], env={"CACHECD_REVERIFY_AFTER_S": "0.5",
                                       "CACHECD_BLOB_FDS_IDLE_S": "0.2"})
    layer = small.layers[-1]
    with d.client() as c:
        fetch_verified(c, small, layer, [5, 6])
        c.stats()  # answers once the commits are done: the blobs are in place
        rotten = _blob(d, small, layer, 5)
        _flip(rotten, 20)
        hub.clear_records()
        # Past the re-hash age, and past the idle time after which the daemon closes its fds.
        time.sleep(1.0)
        fetch_verified(c, small, layer, [5, 6])  # the manifest's bytes, not the rotten ones
        store = c.stats()["store"]
    assert hub.count("cdn_get") == 1  # only the rotten blob was fetched again
    assert store["bit_rot_on_open"] == 1 and store["verified_on_open"] >= 1, store
    assert any(p.name.startswith(rotten.name) for p in (d.cache_dir / "quarantine").iterdir())
    FIGURES.set("s10.rot_caught_on_reverify", store["bit_rot_on_open"])
