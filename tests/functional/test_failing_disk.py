"""A disk that rots blobs under a running daemon, and a daemon that is never idle, as a user's
machine has them: the background scrub finds rot within the window docs/daemon.md promises even
while fetches are in flight, and quarantine/ stays bounded and inside the budget however often
blobs rot. Real daemon, real files, a fake hub only to stall the upstream."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from cachecd import constants
from tests.fakes.fake_hub import FakeHubThread
from tests.harness import TINY_REPO, DaemonProcess

SCRUB_RATE = 64 * 1024
# Pass after pass, as on a cache larger than an hour's scrub: a small cache's scrub otherwise
# rests up to SCRUB_REST_S once it has hashed every blob, and rot waits for the next pass.
NO_REST = {"CACHECD_SCRUB_REST_S": "0"}


def _flip(path: Path) -> None:
    """One byte, in place, same length: rot the daemon cannot see without hashing."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, 0)[0] ^ 0xFF]), 0)
    finally:
        os.close(fd)


def _blob(d: DaemonProcess, digest: str) -> Path:
    return d.cache_dir / "blobs" / digest[:2] / digest


def _until(what: Any, timeout: float, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s")


def test_rot_is_found_within_one_window_while_fetches_wait(tiny_dir: Path, tiny_manifest: Any,
                                                          tiny_manifest_path: Path) -> None:
    m = tiny_manifest
    layer, other = m.moe_layers[0], m.moe_layers[1]
    with FakeHubThread(tiny_dir, repo=TINY_REPO, revision=m.revision) as fake:
        d = DaemonProcess(fake.url, [tiny_manifest_path], args=["--scrub-rate", str(SCRUB_RATE)],
                          env={"CACHECD_READ_TIMEOUT": "120", **NO_REST}).start()
        try:
            with d.client() as c:
                c.experts(TINY_REPO, layer, list(range(32)))
                cached = c.stats()["store"]["bytes"]
            window = cached / SCRUB_RATE + constants.SCRUB_DEFER_S  # docs/daemon.md's promise
            fake.faults.stall_after = 1  # from now on every fetch hangs: the daemon stays busy
            waiter = threading.Thread(target=_ask, args=(d, other), daemon=True)
            waiter.start()
            with d.client() as c:
                _until(lambda: c.stats()["inflight"] > 0, 30)
                passes = c.stats()["scrub"]["passes"]
                rotten = m.expert(layer, 5).digest_hex
                _flip(_blob(d, rotten))
                t0 = time.monotonic()
                _until(lambda: c.stats()["scrub"]["failures"] >= 1, 2 * window + 5, every=0.05)
                found = time.monotonic() - t0
                scrub = _until(lambda: (s := c.stats()["scrub"])["passes"] >= passes + 2 and s,
                               2 * window + 5)
                assert c.stats()["inflight"] > 0, "the daemon was busy the whole time"
            # A pass while busy: within the window (it took 4 times as long, and tiny blobs
            # cost 64 KiB each: 32 s for this cache at 64 KiB/s, 128 s while busy).
            assert scrub["last_pass"]["seconds"] <= window + 1, (scrub, window)
            assert found <= 2 * window + 1, (found, window)  # at worst just scrubbed: 2 passes
            assert scrub["yields"] > 0 and not _blob(d, rotten).exists()
        finally:
            fake.faults.stall_after = None
            d.cleanup()


def _ask(d: DaemonProcess, layer: int) -> None:
    try:
        with d.client(timeout=300) as c:
            c.experts(TINY_REPO, layer, [0])
    except Exception:  # the daemon is stopped under it at the end
        pass


def test_quarantine_stays_bounded_and_in_the_budget(hub: Any, tiny_manifest: Any,
                                                     tiny_manifest_path: Path) -> None:
    m = tiny_manifest
    layer = m.moe_layers[0]
    budget = 24 * int(m.sizes.max())
    d = DaemonProcess(hub.url, [tiny_manifest_path], args=[
        "--budget", str(budget), "--scrub-rate", "64MiB"], env=NO_REST).start()
    try:
        with d.client() as c:
            for rnd in range(8):
                ids = [(rnd * 8 + i) % 32 for i in range(8)]
                c.experts(TINY_REPO, layer, ids)
                failures = c.stats()["scrub"]["failures"]
                for e in ids:
                    _flip(_blob(d, m.expert(layer, e).digest_hex))
                _until(lambda f=failures: c.stats()["scrub"]["failures"] >= f + 8, 30, every=0.02)
            store = c.stats()["store"]
        kept = [p for p in (d.cache_dir / "quarantine").iterdir()]
        assert len(kept) <= constants.QUARANTINE_KEEP, len(kept)  # was 64, growing
        on_disk = sum(p.stat().st_size for p in (d.cache_dir / "blobs").rglob("*") if p.is_file())
        held = sum(p.stat().st_size for p in kept)
        assert store["quarantine_bytes"] == held > 0
        assert on_disk + held <= budget, (on_disk, held, budget)
        assert store["quarantined"] == 64
    finally:
        d.cleanup()
