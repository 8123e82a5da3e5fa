"""The fault suite's harness: tiny models behind a FakeHub, daemons that check the global invariant.

Every daemon here is a real ``cachecd serve`` subprocess (own cache dir, own socket) started with
a fake ``HF_TOKEN`` and DEBUG logs, so secret hygiene is checked on every log the suite makes.
``FaultDaemon.finish`` asserts the global invariant of RELIABILITY.md: fds and tasks back to the
baseline taken at start, a clean SIGTERM exit, no temp files, ``cachecd fsck`` exit 0, no token
and no traceback in the log. Every expert a test reads goes through ``fetch_verified``, which
hashes it against the manifest and counts it, so "bad bytes served" is a measured 0.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from cachecd.errors import ERRORS_BY_CODE, CachecdError
from cachecd.manifest.entries import ExpertEntry
from cachecd.manifest.manifest import Manifest
from tests.faults.figures import FIGURES
from tests.harness import DaemonProcess, keep_headers, short_tmp

# A token-shaped fake: if any of it reaches a log or an error body, the grep below finds it.
FAKE_TOKEN = "hf_" + "FaKe" * 8 + "Tk"
SECRET_RE = re.compile(r"hf_[A-Za-z0-9]{30,}")
REVISION = "f00dfeed" * 5
OTHER_REVISION = "0badc0de" * 5


@dataclass
class Model:
    """A tiny K3-layout checkpoint in ``folder`` and its manifest (repo@revision)."""

    repo: str
    revision: str
    folder: Path
    manifest_path: Path
    manifest: Manifest

    def entry(self, layer: int, expert: int) -> ExpertEntry:
        return self.manifest.expert(layer, expert)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.manifest.moe_layers)

    def all_entries(self) -> list[ExpertEntry]:
        return [self.manifest.entry(i) for i in range(self.manifest.n_experts)]

    def bytes_of(self, entry: ExpertEntry) -> bytes:
        out = bytearray()
        for r in entry.ranges:
            with open(self.folder / r.file, "rb") as f:
                f.seek(r.start)
                out += f.read(r.end - r.start)
        return bytes(out)


def build_model(root: Path, repo: str, revision: str = REVISION, **opts: Any) -> Model:
    from cachecd.manifest.build import build_manifest
    from cachecd.manifest.source import LocalSource
    from cachecd.testbed.tiny_model import write_tiny_model

    folder = root / repo.replace("/", "--")
    write_tiny_model(folder, **opts)
    manifest = build_manifest(LocalSource(folder, repo, revision), progress=False)
    path = root / (repo.replace("/", "--") + ".manifest")
    manifest.save(path)
    return Model(repo, revision, folder, path, Manifest.load(path))


# -- checking what the daemon hands out ---------------------------------------------------------
def check_bytes(model: Model, entry: ExpertEntry, data: Any) -> None:
    """Count ``data`` as served; fail (and count a bad byte) unless it is the manifest's."""
    view = memoryview(data).cast("B")
    FIGURES.add("all.responses_checked")
    FIGURES.add("all.bytes_served", view.nbytes)
    if view.nbytes != entry.nbytes or xxhash.xxh3_128(view).digest() != entry.xxh3:
        FIGURES.add("all.bad_bytes_served", max(1, view.nbytes))
        raise AssertionError(
            f"daemon served wrong bytes for layer {entry.layer} expert {entry.expert} "
            f"({view.nbytes} bytes, expected {entry.nbytes})"
        )


def check_error(exc: CachecdError) -> CachecdError:
    """A typed error from the daemon: a known code, and no secret in its message."""
    FIGURES.add("all.error_bodies_checked")
    secrets = SECRET_RE.findall(exc.message)
    FIGURES.add("all.secrets_found", len(secrets))
    assert not secrets, f"a token-shaped string in an error message: {exc.message[:200]}"
    assert exc.code in ERRORS_BY_CODE, exc.code
    return exc


def fetch_verified(client: Any, model: Model, layer: int, ids: list[int]) -> list[bytes]:
    """Experts through the fd data path, each checked against the manifest."""
    try:
        arrays = client.experts(model.repo, layer, ids)
    except CachecdError as exc:
        check_error(exc)
        raise
    out = []
    for e, arr in zip(ids, arrays, strict=True):
        check_bytes(model, model.entry(layer, e), arr)
        out.append(arr.tobytes())
    return out


# -- raw HTTP on the control socket -------------------------------------------------------------
class _UnixConn(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(str(self._path))
        self.sock = s


def http_request(
    sock_path: Path, method: str, path: str, body: bytes | None = None,
    headers: dict[str, str] | None = None, timeout: float = 60,
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection; an error answer is checked for the wire form."""
    conn = _UnixConn(sock_path, timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        status, hdrs = resp.status, dict(resp.getheaders())
    finally:
        conn.close()
    if status >= 400:
        check_wire_error(status, data)
    return status, hdrs, data


def check_wire_error(status: int, data: bytes) -> dict[str, Any]:
    """``{"error", "message", "retryable"}`` with a known code and no secret in it."""
    FIGURES.add("all.error_bodies_checked")
    text = data.decode("utf-8", "replace")
    found = SECRET_RE.findall(text)
    FIGURES.add("all.secrets_found", len(found))
    assert not found, f"a token-shaped string in an error body: {text[:200]}"
    payload = json.loads(data)
    assert set(payload) >= {"error", "message", "retryable"}, payload
    assert payload["error"] in ERRORS_BY_CODE, payload
    return payload


# -- /proc views of the daemon ------------------------------------------------------------------
def _tcp_inodes(pid: int) -> set[str]:
    out: set[str] = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                next(f)
                out.update(line.split()[9] for line in f if line.strip())
        except (FileNotFoundError, StopIteration):
            continue
    return out


def fd_census(pid: int) -> dict[str, int]:
    """The daemon's fds: ``tcp`` (the upstream keep-alive pool) and ``other`` (everything else:
    blobs, temps, LMDB, listening and client sockets)."""
    tcp = _tcp_inodes(pid)
    counts = {"tcp": 0, "other": 0}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        inode = link[8:-1] if link.startswith("socket:[") else None
        counts["tcp" if inode in tcp else "other"] += 1
    return counts


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def files_under(root: Path) -> list[Path]:
    return [Path(dp, f) for dp, _, fs in os.walk(root) for f in fs] if root.exists() else []


def bytes_under(root: Path) -> int:
    total = 0
    for p in files_under(root):
        try:
            total += p.lstat().st_size
        except FileNotFoundError:
            pass
    return total


_DISK_SAMPLER = r"""
import json, os, signal, sys, time
root, interval = sys.argv[1], float(sys.argv[2])
stop = False
def _stop(*a):
    global stop
    stop = True
signal.signal(signal.SIGTERM, _stop)
def walk(path, seen):
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total
peak_blobs = peak_total = samples = torn = 0
print("ready", flush=True)
while not stop:
    seen = set()
    tmp = walk(os.path.join(root, "tmp"), seen)  # first: a temp renamed meanwhile counts once
    blobs = walk(os.path.join(root, "blobs"), seen)
    after = set()
    walk(os.path.join(root, "tmp"), after)
    walk(os.path.join(root, "blobs"), after)
    if seen <= after:  # all counted files still there: they were all there at once
        peak_blobs, peak_total = max(peak_blobs, blobs), max(peak_total, blobs + tmp)
        samples += 1
    else:  # one went during the walk (evicted), and its successor may be counted beside it
        torn += 1
    time.sleep(interval)
print(json.dumps({"peak_blobs": peak_blobs, "peak_total": peak_total, "samples": samples,
                  "torn": torn}))
"""


class DiskSampler:
    """Bytes under a cache dir's tmp/ and blobs/ every 50 ms, in its own process: a walk is not
    atomic, and in a thread of a busy test process (the GIL) one walk can take long enough for
    blobs evicted and temps written meanwhile both to be counted. Each file counts once (by
    inode), tmp/ first, so a temp renamed into blobs/ during the walk is not counted twice. A
    walk during which a file it counted went away (evicted) is torn: the file that took its
    place may be counted beside it, a sum that never was on the disk (on a loaded machine, with
    slow walks, 4.57 MB over a 4 MiB budget was seen). A torn walk is not a sample (``torn``
    counts them); a kept one counted files that all existed at its end, each at most its size
    then (blobs do not change; temps only grow), so it never overstates the disk."""

    def __init__(self, d: DaemonProcess, interval: float = 0.05) -> None:
        self.peak_blobs = self.peak_total = self.samples = self.torn = 0
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _DISK_SAMPLER, str(d.cache_dir), str(interval)],
            stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        assert self._proc.stdout.readline().strip() == "ready"

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
        out, _ = self._proc.communicate(timeout=30)
        got = json.loads(out.strip().splitlines()[-1])
        self.peak_blobs, self.peak_total, self.samples, self.torn = (
            got["peak_blobs"], got["peak_total"], got["samples"], got["torn"])


# -- the daemon ---------------------------------------------------------------------------------
class FaultDaemon(DaemonProcess):
    """A ``cachecd serve`` subprocess that knows its baseline and checks the global invariant."""

    def __init__(self, endpoint: str, models: list[Model], *, args: list[str] = (),
                 env: dict[str, str] | None = None, wrap: list[str] = (), **kw: Any) -> None:
        super().__init__(endpoint, [m.manifest_path for m in models], args=list(args), **kw)
        self.models = models
        for m in models:  # as setup leaves them: the scenarios are about expert bytes
            keep_headers(self.base / "models", m.manifest, m.folder, endpoint)
        self.wrap = list(wrap)
        self.set_env(env)
        self.baseline: tuple[int, int] | None = None
        self.allow_tracebacks = False
        self.expect_killed = False

    def set_env(self, env: dict[str, str] | None) -> None:
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("CACHECD_", "HF_")) and k != "PYTEST_CURRENT_TEST"}
        (self.base / "empty.toml").touch()  # no user config reaches the daemon
        self.env = {**base, "HF_TOKEN": FAKE_TOKEN, "HF_HUB_DISABLE_TELEMETRY": "1",
                    "CACHECD_LOG_LEVEL": "DEBUG", "CACHECD_CONFIG": str(self.base / "empty.toml"),
                    **(env or {})}

    @property
    def argv(self) -> list[str]:
        return self.wrap + super().argv

    @property
    def max_parallel(self) -> int:
        args = self.extra
        return int(args[args.index("--max-parallel") + 1]) if "--max-parallel" in args else 8

    @property
    def pid(self) -> int:
        """The daemon's pid (under ``wrap``, e.g. strace, the wrapper's child)."""
        assert self.proc is not None
        if not self.wrap:
            return self.proc.pid
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return int(f.read().split()[0])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if not self.wrap or not self.running():
            return super().stop(sig, timeout)
        os.kill(self.pid, sig)  # the wrapper (strace) exits with its child's status
        assert self.proc is not None
        return self.proc.wait(timeout)

    def start(self, timeout: float = 60, baseline: bool = True) -> FaultDaemon:
        super().start(timeout)
        FIGURES.add("all.daemon_starts")
        self.expect_killed = False
        if baseline:
            self.baseline = self.settle_counts(None)
        return self

    def counts(self) -> tuple[int, int]:
        """(non-TCP fds, asyncio tasks), asked on a fresh connection that is then closed."""
        with self.client(timeout=10) as c:
            tasks = int(c.stats()["debug"]["tasks"])
        return fd_census(self.pid)["other"], tasks

    def settle_counts(self, target: tuple[int, int] | None, timeout: float = 5.0) -> tuple[int, int]:
        """Counts once closed connections are gone. No target: the minimum of four samples (the
        baseline). A target: sample until both counts are at or under it, or ``timeout``."""
        best = self.counts()

        def better() -> tuple[int, int]:
            time.sleep(0.1)
            now = self.counts()
            return min(best[0], now[0]), min(best[1], now[1])

        if target is None:
            for _ in range(3):
                best = better()
            return best
        deadline = time.monotonic() + timeout
        while (best[0] > target[0] or best[1] > target[1]) and time.monotonic() < deadline:
            best = better()
        return best

    def status(self) -> dict[str, Any]:
        with self.client(timeout=10) as c:
            return c.stats()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.expect_killed = True
        FIGURES.add("all.kill9")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def finish(self) -> None:
        """The global invariant, then stop. Safe to call on a daemon that is already dead."""
        try:
            if self.running():
                self._check_baseline()
                t0 = time.monotonic()
                code = self.stop()
                FIGURES.peak("all.stop_seconds_max", round(time.monotonic() - t0, 3))
                assert code == 0, f"daemon exited {code} on SIGTERM:\n{self.log()[-3000:]}"
                assert not self.socket.exists(), "control socket left behind"
                assert not Path(str(self.socket) + ".data").exists(), "data socket left behind"
            elif self.proc is not None and self.proc.returncode and not self.expect_killed:
                raise AssertionError(f"daemon died ({self.proc.returncode}):\n{self.log()[-3000:]}")
            if self.cache_dir.exists():
                self.check_cache_clean()
            self.check_log()
        finally:
            self.cleanup()

    def _check_baseline(self) -> None:
        if self.baseline is None:
            return
        got = self.settle_counts(self.baseline)
        FIGURES.add("all.baseline_checks")
        # The upstream keep-alive pool is not part of the baseline, but it is bounded.
        tcp = fd_census(self.pid)["tcp"]
        FIGURES.peak("all.upstream_connections_max", tcp)
        assert tcp <= self.max_parallel + 4, f"{tcp} upstream connections open"
        assert got[0] <= self.baseline[0], f"fds: {got[0]} open, baseline {self.baseline[0]}"
        assert got[1] <= self.baseline[1], f"tasks: {got[1]} alive, baseline {self.baseline[1]}"

    def check_cache_clean(self) -> None:
        temps = files_under(self.cache_dir / "tmp")
        assert not temps, f"temp files left: {temps}"
        leftovers = [p for p in files_under(self.base / "models") if p.name.startswith(".tmp")]
        assert not leftovers, f"temp manifests left: {leftovers}"
        rc = fsck_exit_code(self.cache_dir)
        FIGURES.add("all.fsck_runs")
        assert rc == 0, f"cachecd fsck --cache-dir {self.cache_dir} exited {rc}"

    def check_log(self) -> None:
        text = self.log()
        found = SECRET_RE.findall(text)
        FIGURES.add("all.log_bytes_grepped", len(text))
        FIGURES.add("all.secrets_found", len(found))
        assert not found, "a token-shaped string reached the daemon log"
        tracebacks = text.count("Traceback (most recent call last)")
        FIGURES.add("all.tracebacks_in_logs", tracebacks)
        if not self.allow_tracebacks:
            assert tracebacks == 0, f"traceback in the daemon log:\n{_first_traceback(text)}"


def _first_traceback(text: str) -> str:
    i = text.find("Traceback (most recent call last)")
    return text[max(0, i - 300): i + 2500]


def fsck_exit_code(cache_dir: Path, *extra: str) -> int:
    """``cachecd fsck --cache-dir D``'s exit code: the command's own code path, run in-process
    (a subprocess per check would cost the suite a second of interpreter start each)."""
    from cachecd.cli import main

    return main(["fsck", "--cache-dir", str(cache_dir), *extra])


def fsck_cli(cache_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The real ``cachecd fsck`` process, for the checks whose point is the exit code."""
    from tests.harness import CACHECD

    return subprocess.run([*CACHECD, "fsck", "--cache-dir", str(cache_dir), *extra],
                          capture_output=True, text=True, timeout=120)


def new_dir(prefix: str = "cdf") -> Path:
    return short_tmp(prefix)
