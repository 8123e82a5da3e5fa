"""A /healthz probe in its own process, so the test process's GIL and threads cannot skew it.

It answers n (probes that succeeded), fails, max_ms and p50_ms when stopped.
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
path, interval = sys.argv[1], float(sys.argv[2])
stop = False
def _stop(*a):
    global stop
    stop = True
signal.signal(signal.SIGTERM, _stop)
lat, fails, s = [], 0, None
req = b"GET /healthz HTTP/1.1\r\nHost: d\r\n\r\n"
print("ready", flush=True)
while not stop:
    t0 = time.perf_counter()
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
        lat.append(time.perf_counter() - t0)
    except OSError:
        fails += 1
        if s is not None: s.close()
        s = None
    time.sleep(interval)
lat.sort()
print(json.dumps({"n": len(lat), "fails": fails, "max_ms": 1000 * lat[-1] if lat else None,
                  "p50_ms": 1000 * lat[len(lat) // 2] if lat else None}), flush=True)
"""


class HealthProbe:
    """GET /healthz every ``interval`` s until ``stop()``; returns n, fails, max_ms, p50_ms."""

    def __init__(self, sock_path: Path, interval: float = 0.02) -> None:
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", _PROBE, str(sock_path),
                                      str(interval)], stdout=subprocess.PIPE, text=True)
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


def record_health(sid: str, result: dict[str, Any]) -> float:
    """Record a probe's figures; returns the worst latency in ms."""
    FIGURES.add(f"{sid}.health_probes", result["n"])
    worst = result["max_ms"] if result["max_ms"] is not None else float("inf")
    FIGURES.peak(f"{sid}.health_max_ms", round(worst, 1))
    FIGURES.peak("all.health_max_ms", round(worst, 1))
    return worst
