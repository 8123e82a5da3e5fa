"""Opening a K3-sized cache: 82,432 indexed blobs, after a clean stop and after a crash.

Builds a cache dir holding K3's number of routed experts (92 layers x 896) as blob files with an
LMDB row, a source row, an access count and a coverage row each, as a daemon leaves them after warming the
whole model. The blobs hold 32 bytes each: what opening costs grows with the number of files
and rows (a directory walk, a stat per file, the index read, the policy built), not with their
size. Then, alternating, in this process (page cache hot after the warm-up round):
  clean: ``Store.open_sync`` after an orderly close (the index is trusted; no walk);
  crash: the same after a kill -9, with the full scan recovery does then (every file under
         blobs/ stat'ed and matched to its row, strays hashed);
and, once each, the whole daemon: ``cachecd serve`` started on the cache until it answers a
health check, after SIGTERM and after kill -9 (Python's start and imports included).
The bar (DESIGN.md "Scale"): a K3-sized index loads in <= 1 s. Last line: ``crash_open_s=X``.

    python bench/index_start.py [--experts 82432] [--rounds 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import tempfile
import time
from pathlib import Path

import xxhash
from _common import add_common_args, alternate, median

from cachecd import constants
from cachecd.store import sources
from cachecd.store.index import Entry
from cachecd.store.recovery import CLEAN_KEY
from cachecd.store.store import Store
from tests.harness import DaemonProcess

MODEL = "moonshotai/Kimi-K3@" + "ab" * 20


def build(cache: Path, n: int) -> None:
    store = Store.open_sync([cache])
    try:
        rows: dict[str, Entry] = {}
        made: set[str] = set()
        for i in range(n):
            data = i.to_bytes(8, "little") * 4
            digest = xxhash.xxh3_128(data).hexdigest()
            sub = cache / "blobs" / digest[:2]
            if digest[:2] not in made:
                sub.mkdir(exist_ok=True)
                made.add(digest[:2])
            (sub / digest).write_bytes(data)
            rows[digest] = Entry(0, len(data), time.time())
            layer, expert = divmod(i, constants.K3_EXPERTS_PER_LAYER)
            store.index.record_access(digest, MODEL, layer + 1, expert, time.time() - n + i)
        store.index.put_entries(rows).result()
        # Each blob's source key, as a commit records it (store/sources.py); the key's value
        # does not matter to the open, only the rows' number.
        sources.put(store.index, [(d, d, sources.ORIGIN_SOURCE) for d in rows]).result()
    finally:
        store.close_sync()


def open_clean(cache: Path) -> float:
    t0 = time.perf_counter()
    store = Store.open_sync([cache])
    took = time.perf_counter() - t0
    assert not store.recovery.full_scan
    store.close_sync()
    return took


def open_after_crash(cache: Path, n: int) -> float:
    store = Store.open_sync([cache])
    store.index.put_meta(CLEAN_KEY, None).result()  # what a kill -9 leaves: no clean flag
    store.index.close()  # the flag stays cleared: no orderly close
    store.blobs.release()
    t0 = time.perf_counter()
    store = Store.open_sync([cache])
    took = time.perf_counter() - t0
    report = store.recovery
    assert report.full_scan and report.entries == n and report.rows_dropped == 0, report
    store.close_sync()
    return took


def daemon_start(cache: Path, crash: bool) -> float:
    """Start ``cachecd serve`` on ``cache``, stop it as ``crash`` says, and time its next start
    until it answers a health check."""
    d = DaemonProcess(constants.HF_ENDPOINT, cache_dir=cache, args=["--scrub-rate", "0"],
                      env={"HF_HUB_OFFLINE": "1"})
    try:
        d.start()
        d.stop(signal.SIGKILL if crash else signal.SIGTERM)
        t0 = time.perf_counter()
        d.start(poll=0.005)
        took = time.perf_counter() - t0
        recovery = [ln for ln in d.log().splitlines() if "event=recovery" in ln][-1]
        assert f"full_scan={crash}" in recovery, recovery
        return took
    finally:
        d.stop()
        shutil.rmtree(d.base, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int,
                    default=constants.K3_MOE_LAYERS * constants.K3_EXPERTS_PER_LAYER)
    add_common_args(ap, rounds=5)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="index-start-", dir=args.dir))
    try:
        cache = work / "cache"
        t0 = time.perf_counter()
        build(cache, args.experts)
        print(f"built {args.experts} blobs, rows and access counts in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        times = alternate({"clean": lambda: open_clean(cache),
                           "crash": lambda: open_after_crash(cache, args.experts)},
                          args.rounds, show=lambda k, v: f"{k}_open_s={v:.3f}")
        serve_clean = daemon_start(cache, crash=False)
        serve_crash = daemon_start(cache, crash=True)
        print(f"index_start: {args.experts} entries, {args.rounds} rounds (median), "
              f"in-process Store.open")
        print(f"clean_open_s={median(times['clean']):.3f} (max {max(times['clean']):.3f})  "
              f"crash_open_s={median(times['crash']):.3f} (max {max(times['crash']):.3f})")
        print(f"info: cachecd serve until it answers: after SIGTERM {serve_clean:.3f} s, "
              f"after kill -9 {serve_crash:.3f} s (Python start and imports included)")
        print(f"crash_open_s={median(times['crash']):.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
