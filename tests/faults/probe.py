"""A /healthz probe in its own process, so the test process's GIL and threads cannot skew it.

It answers n (probes that succeeded), fails, max_ms and p50_ms (wall clock) when stopped, and
own_max_ms: each probe's wall time less the time the probe and the daemon's event-loop thread
spent runnable but waiting for a CPU while it was out, the larger of the two (Linux's
per-thread run delay, /proc/PID/task/TID/schedstat). That wait is the machine's other work, not
the daemon's: what the bar checks is that the daemon never holds its loop, which own_max_ms
measures whatever else the machine runs. Time the loop runs or sleeps (a blocking call, the GIL
held by another thread of the daemon) stays in it. The loop's wait is left out only when the
loop was asleep as the probe began, so that all of that wait lies inside the probe; a probe that
found the loop runnable leaves out only its own. Where run delays cannot be read (not Linux),
own_max_ms is max_ms.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.faults.figures import FIGURES

_PROBE = r"""
import json, signal, socket, sys, time
path, interval, pid = sys.argv[1], float(sys.argv[2]), sys.argv[3]
def _delay(stat):
    try:
        with open(stat) as f:
            return int(f.read().split()[1]) / 1e9  # ns runnable but not running, so far
    except (OSError, IndexError, ValueError):
        return 0.0
stats = ["/proc/thread-self/schedstat"] + ([f"/proc/{pid}/task/{pid}/schedstat"] if pid else [])
def waited():
    return [_delay(s) for s in stats]
def loop_runnable():
    # R: the loop may be waiting for a CPU already, a wait that began before this probe and
    # would be counted whole at its end; then only the probe's own wait is left out.
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "R"
    except (OSError, IndexError):
        return True
stop = False
def _stop(*a):
    global stop
    stop = True
signal.signal(signal.SIGTERM, _stop)
lat, own, fails, s = [], [], 0, None
req = b"GET /healthz HTTP/1.1\r\nHost: d\r\n\r\n"
print("ready", flush=True)
while not stop:
    # The window holds both reads of the run delays: every wait counted in it lies inside it.
    t0 = time.perf_counter()
    busy = bool(pid) and loop_runnable()
    w0 = waited()
    try:
        if s is None:
            s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(path)
        s.sendall(req)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk: raise OSError("closed")
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        n = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0].split(b":")[1])
        while len(body) < n:
            chunk = s.recv(65536)
            if not chunk: raise OSError("closed")
            body += chunk
        if not head.startswith(b"HTTP/1.1 200"): raise OSError(head[:40])
        w1 = waited()
        lat.append(time.perf_counter() - t0)
        # The larger of the two waits, not their sum: they may overlap, and a sum could hide
        # time the loop was held; the larger one never does.
        waits = [b - a for a, b in zip(w0, w1)][:1 if busy else 2]
        own.append(max(0.0, lat[-1] - max(waits)))
    except OSError:
        fails += 1
        if s is not None: s.close()
        s = None
    time.sleep(interval)
lat.sort()
print(json.dumps({"n": len(lat), "fails": fails, "max_ms": 1000 * lat[-1] if lat else None,
                  "p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
                  "own_max_ms": 1000 * max(own) if own else None}), flush=True)
"""


class HealthProbe:
    """GET /healthz every ``interval`` s until ``stop()``; returns n, fails, max_ms, p50_ms and
    own_max_ms (less the CPU waits of the probe and of ``pid``'s main thread, the daemon's event
    loop)."""

    def __init__(self, sock_path: Path, pid: int | None = None, interval: float = 0.02) -> None:
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", _PROBE, str(sock_path),
                                      str(interval), str(pid or "")], stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        return json.loads(out.strip().splitlines()[-1])

    def __enter__(self) -> HealthProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_delay_s() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux schedstat; 0
    where it cannot be read): time taken by the machine's other work, to leave out of a bar on
    what this thread's own calls take."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def record_health(sid: str, result: dict[str, Any]) -> float:
    """Record a probe's figures (wall clock and the daemon's own); returns the worst of the
    daemon's own latencies in ms, what the 100 ms bar is about."""
    FIGURES.add(f"{sid}.health_probes", result["n"])
    wall = result["max_ms"] if result["max_ms"] is not None else float("inf")
    own = result["own_max_ms"] if result["own_max_ms"] is not None else float("inf")
    FIGURES.peak(f"{sid}.health_max_ms", round(wall, 1))
    FIGURES.peak("all.health_max_ms", round(wall, 1))
    FIGURES.peak(f"{sid}.health_own_max_ms", round(own, 1))
    FIGURES.peak("all.health_own_max_ms", round(own, 1))
    return own
