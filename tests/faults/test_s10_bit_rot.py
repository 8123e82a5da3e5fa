"""Scenario 10: bit rot, a short blob, a missing blob and stray files in a stopped cache.

``cachecd fsck`` (the real command) reports them with its exit bitmask (1 corrupt, 4
unverifiable), ``--fast`` sees sizes only, ``--repair`` quarantines and drops rows, and the
restarted daemon refetches good bytes. Without fsck, a running daemon's open drops a missing or
short blob and refetches it, and a blob the daemon did not commit itself is hashed on its first
open, so rot at rest (a flipped byte, same length) is quarantined and refetched; so is rot
that sets in while the daemon runs, at the blob's first open once its last hash is older than
REVERIFY_AFTER_S (shortened here). Those tests turn the background scrub off, so that what they
measure is the open path. A byte flipped while the daemon holds the blob open and serves it
without re-hashing (the zero-copy hit path) is caught by the background scrub: from its verdict
on, no request gets the rotten blob; before it, hits serve it, and the figures say how many.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import xxhash
from prometheus_client.parser import text_string_to_metric_families

from tests.faults.figures import FIGURES
from tests.faults.support import (
    FaultDaemon,
    Model,
    check_bytes,
    fetch_verified,
    fsck_cli,
    http_request,
)
from tests.harness import run_cli

NO_SCRUB = ["--scrub-rate", "0"]  # for the tests of what the open path catches


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
    d = pool.daemon(hub, [small], args=NO_SCRUB)
    layer = small.layers[1]
    with d.client() as c:
        fetch_verified(c, small, layer, [0, 1, 2])
        c.stats()  # answers once the commits are done: the blobs are in place
        _blob(d, small, layer, 0).unlink()
        short = _blob(d, small, layer, 1)
        os.truncate(short, 100)
        hub.clear_records()
        fetch_verified(c, small, layer, [0, 1, 2])
        store = c.stats()["store"]
    assert hub.count("cdn_get") == 2
    assert store["quarantined"] == 1  # the short one; the missing one had nothing to keep
    FIGURES.set("s10.open_refetched_missing_or_short", hub.count("cdn_get"))


def _in_place(path: Path, offset: int) -> None:
    """Flip a byte with pwrite: same inode, same length, through the page cache that the
    daemon's open fds read."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


def _holds(d: FaultDaemon, path: Path) -> bool:
    """Whether the daemon has ``path`` open (its fd cache keeps the fds of blobs in use)."""
    for fd in os.listdir(f"/proc/{d.pid}/fd"):
        try:
            if os.readlink(f"/proc/{d.pid}/fd/{fd}") == str(path):
                return True
        except FileNotFoundError:
            continue
    return False


def test_rot_under_a_running_daemon_is_never_served_after_the_scrub_passes_it(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    # A fast scrub, pass after pass (no rest between them, as a cache larger than an hour's
    # scrub has). The reader below never pauses (an engine decoding), so the daemon keeps the
    # blob's fd (closed after BLOB_FDS_IDLE_S without a hit, here 2 s, after the test).
    d = pool.daemon(hub, [small], args=["--scrub-rate", "1MiB"],
                    env={"CACHECD_BLOB_FDS_IDLE_S": "2", "CACHECD_SCRUB_REST_S": "0"})
    layer, ids, target = small.layers[3], list(range(8)), 5
    entry = small.entry(layer, target)
    with d.client() as c:
        fetch_verified(c, small, layer, ids)
        c.stats()  # answers once the commits are done: the blobs are in place
    rotten = _blob(d, small, layer, target)
    answers: list[tuple[float, bool]] = []  # (wall time the request left, bytes were good)
    stop = threading.Event()

    def hits() -> None:
        with d.client() as c:
            while not stop.is_set():
                sent = time.time()
                got = c.experts(small.repo, layer, [target])[0]
                good = xxhash.xxh3_128(got).digest() == entry.xxh3
                if good:
                    check_bytes(small, entry, got)
                answers.append((sent, good))

    reader = threading.Thread(target=hits)
    reader.start()
    try:
        while not answers:
            time.sleep(0.01)
        held = _holds(d, rotten)
        hub.clear_records()
        flipped = time.time()
        _in_place(rotten, 1234)
        deadline = time.monotonic() + 60
        while d.status()["scrub"]["failures"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        scrub = d.status()["scrub"]
        assert scrub["failures"] >= 1, f"the scrub never failed the rotten blob: {scrub}"
        verdict = scrub["last_failure"]["at"]  # taken once the blob left the index
        time.sleep(0.5)  # hits go on after the verdict
    finally:
        stop.set()
        reader.join(30)
    assert held, "the daemon did not hold the blob open: the scenario is not the one meant"
    assert scrub["failures"] == 1 and scrub["last_failure"]["digest"] == entry.digest_hex
    after = [good for sent, good in answers if sent > verdict]
    rotten_before = sum(1 for sent, good in answers if flipped < sent <= verdict and not good)
    assert after and all(after), f"{after.count(False)} of {len(after)} hits after the verdict were rotten"
    assert hub.count("cdn_get") == 1  # fetched again once, then hits again
    assert any(p.name.startswith(rotten.name) for p in (d.cache_dir / "quarantine").iterdir())
    store = d.status()["store"]
    assert store["bit_rot_on_open"] == 0  # the scrub caught it, not an open
    _, _, metrics = http_request(d.socket, "GET", "/metrics")
    counted = {s.name: s.value for f in text_string_to_metric_families(metrics.decode())
               for s in f.samples}
    assert counted["cachecd_scrub_failures_total"] == 1 and counted["cachecd_scrub_passes_total"] >= 1
    out = run_cli("status", "--socket", str(d.socket)).stdout  # what the user sees
    assert "failed their hash in the background scrub" in out and "last scrub  full pass" in out, out
    FIGURES.set("s10.rot_held_open_caught_by_scrub", scrub["failures"])
    FIGURES.set("s10.scrub_verdict_after_flip_s", round(verdict - flipped, 3))
    FIGURES.set("s10.rotted_hits_served_before_scrub_verdict", rotten_before)
    FIGURES.set("s10.rotted_hits_served_after_scrub_verdict", after.count(False))
    FIGURES.set("s10.hits_checked_after_scrub_verdict", len(after))


def test_rot_at_rest_is_caught_on_the_first_open_after_a_restart(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    d = pool.daemon(hub, [small], args=NO_SCRUB)
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
    d = pool.daemon(hub, [small], args=NO_SCRUB, env={"CACHECD_REVERIFY_AFTER_S": "0.5",
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
