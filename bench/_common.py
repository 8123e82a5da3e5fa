"""Shared pieces of the benches: a served checkpoint, a daemon, blob paths, alternating rounds.

Invariants every bench keeps through these helpers:
- Baseline and ours run in the same process, alternating (the order changes every round,
  through every permutation), after one warm-up round that is not counted; results are
  medians over rounds.
- Generated data lives in one work dir under ``--dir`` (default /tmp) and is removed at the end,
  with every process the bench started.
- Numbers are printed as measured; the last line a bench prints is ``ratio=X`` (ours/baseline,
  higher is better).

The benches reuse the functional-test harness (real ``cachecd hub serve`` and ``cachecd serve``
processes), so the repo root goes on ``sys.path`` when a bench runs as a script.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from cachecd.manifest.manifest import Manifest  # noqa: E402
from tests.harness import DaemonProcess, HubProcess, run_cli, short_tmp  # noqa: E402

GIB = float(1 << 30)
# One K3 expert: w1/w3 [3072, 3584] and w2 [3584, 3072] in mxfp4 (DESIGN.md).
K3_SHAPE = {"expert_hidden": 3584, "moe_intermediate": 3072}


def add_common_args(ap: argparse.ArgumentParser, rounds: int) -> None:
    ap.add_argument("--dir", default="/tmp", help="where the work dir (removed at the end) goes")
    ap.add_argument("--rounds", type=int, default=rounds, help="measured rounds (median)")


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternate(
    cases: dict[str, Callable[[], float]],
    rounds: int,
    show: Callable[[str, float], str] = lambda k, v: f"{k}={v:.6f}",
) -> dict[str, list[float]]:
    """Run each case once to warm up, then ``rounds`` rounds, cycling through every order.

    With two cases the order alternates; with three, each case follows each other one equally
    often, so whatever one case leaves behind (a daemon still flushing, dirty pages) does not
    always land on the same neighbour.
    """
    for fn in cases.values():
        fn()
    names = list(cases)
    orders = list(itertools.permutations(names))
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in orders[r % len(orders)]:
            out[k].append(cases[k]())
        print(f"round={r} " + " ".join(show(k, out[k][-1]) for k in names), flush=True)
    return out


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def paired_ratio(ours: Sequence[float], base: Sequence[float]) -> float:
    """Median over rounds of ``ours[r] / base[r]``: each round's pair ran back to back, so a
    slow stretch of a shared machine hits both and cancels out (rates in; invert for times)."""
    return median([o / b for o, b in zip(ours, base, strict=True)])


@dataclass
class Served:
    """A checkpoint under ``hub_root/repo``, served by ``cachecd hub serve``, with its manifest."""

    work: Path
    repo: str
    hub: HubProcess
    manifest_path: Path
    manifest: Manifest
    daemons: list[DaemonProcess] = field(default_factory=list)

    @property
    def repo_dir(self) -> Path:
        return self.work / "hub" / self.repo

    def daemon(self, cache_dir: Path | None = None, args: tuple[str, ...] = ()) -> DaemonProcess:
        """A started daemon; ``cache_dir`` defaults to a fresh one under the work dir."""
        cache = cache_dir or Path(tempfile.mkdtemp(prefix="cache-", dir=self.work))
        d = DaemonProcess(self.hub.url, [self.manifest_path], cache_dir=cache, args=list(args))
        try:
            d.start()
        except BaseException:
            d.cleanup()  # its socket dir lives outside the work dir
            raise
        self.daemons.append(d)
        return d

    @contextlib.contextmanager
    def running_daemon(self) -> Iterator[DaemonProcess]:
        """A started daemon with a fresh cache, stopped and removed at the end."""
        d = self.daemon()
        try:
            yield d
        finally:
            self.drop(d)

    def drop(self, d: DaemonProcess) -> None:
        """Stop a daemon and remove its cache (a cold cache for the next one)."""
        d.stop()
        d.cleanup()
        shutil.rmtree(d.cache_dir, ignore_errors=True)
        self.daemons.remove(d)

    def blob_paths(self, cache_dir: Path, layer: int, ids: Sequence[int]) -> list[Path]:
        """Where the daemon keeps these experts (cache layout: blobs/<2 hex>/<digest>)."""
        out = []
        for e in ids:
            d = self.manifest.expert(layer, e).digest_hex
            path = cache_dir / "blobs" / d[:2] / d
            if not path.is_file():
                raise SystemExit(f"no blob at {path}: is the expert cached?")
            out.append(path)
        return out


@contextlib.contextmanager
def served_checkpoint(base: str, repo: str, written: Callable[[Path], None] | None = None,
                      **tiny_opts: Any) -> Iterator[Served]:
    """Write a tiny-model checkpoint (``written`` may change its files then), serve it, build its
    manifest; clean everything at the end."""
    from cachecd.testbed.tiny_model import write_tiny_model

    work = Path(tempfile.mkdtemp(prefix="cd-bench-", dir=base))
    hub: HubProcess | None = None
    served: Served | None = None
    try:
        t0 = time.perf_counter()
        write_tiny_model(work / "hub" / repo, **tiny_opts)
        if written is not None:
            written(work / "hub" / repo)
        hub = HubProcess(work / "hub")
        manifest_path = work / "bench.manifest"
        run_cli(
            "manifest",
            "build",
            f"{repo}@main",
            "--endpoint",
            hub.url,
            "--output",
            str(manifest_path),
            timeout=1800,
        )
        served = Served(work, repo, hub, manifest_path, Manifest.load(manifest_path))
        print(
            f"setup: checkpoint+hub+manifest in {time.perf_counter() - t0:.1f}s "
            f"experts={served.manifest.n_experts} expert_bytes={int(served.manifest.sizes[0])} "
            f"work={work}",
            flush=True,
        )
        yield served
    finally:
        for d in list(served.daemons) if served else []:
            d.cleanup()
        if hub is not None:
            hub.stop()
        shutil.rmtree(work, ignore_errors=True)


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (``/proc/PID/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def touched_buffers(n: int, size: int, align: int = 64) -> list[Any]:
    """``n`` uint8 buffers of ``size`` bytes, written once (no page faults inside a round) and
    starting on a cache line: the kernel copies page-cache bytes into such memory about 3x
    faster here than into memory 16 bytes past one, which is where malloc puts big arrays."""
    import numpy as np

    out = []
    for _ in range(n):
        raw = np.ones(size + align, np.uint8)
        off = -raw.ctypes.data % align
        out.append(raw[off : off + size])
    return out


def open_all(paths: Sequence[Path]) -> list[int]:
    return [os.open(p, os.O_RDONLY) for p in paths]


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


@contextlib.contextmanager
def installed(served: Served) -> Iterator[tuple[Path, Path]]:
    """``cachecd setup --stream`` with the cache and models under the work dir (the socket in a
    short temp dir); yields (socket, cache dir); stops the daemon and removes both."""
    base = short_tmp("cdeng")
    sock = base / "run" / "s.sock"
    cache = Path(tempfile.mkdtemp(prefix="installed-", dir=served.work))
    try:
        run_cli(
            "setup",
            "--stream",
            served.repo,
            "--endpoint",
            served.hub.url,
            "--socket",
            str(sock),
            "--cache-dir",
            str(cache / "cache"),
            "--models-dir",
            str(cache / "models"),
            "--manifest",
            str(served.manifest_path),
        )
        yield sock, cache / "cache"
    finally:
        _stop_daemon(sock)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)


def _stop_daemon(sock: Path) -> None:
    from cachecd.errors import DaemonUnavailable
    from cachecd_client import Client

    try:
        with Client(sock, timeout=5) as c:
            pid = int(c.health()["pid"])
    except DaemonUnavailable:
        return
    os.kill(pid, signal.SIGTERM)
    for _ in range(400):
        if not sock.exists():
            return
        time.sleep(0.05)


def warm_disk(sock: Path, served: Served) -> None:
    from cachecd_client import Client

    m = served.manifest
    with Client(sock) as c:
        for layer in m.moe_layers:
            c.experts(served.repo, layer, list(range(m.experts_per_layer)))
        c.stats()  # a miss is answered before its blob is committed: status waits for those
