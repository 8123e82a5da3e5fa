"""``cachecd demo``: the whole product end to end on an embedded tiny K3, offline.

It generates the tiny checkpoint, serves it with ``cachecd hub serve``, runs ``cachecd setup
--stream`` (which starts a daemon), generates through the daemon with ``cachecd run``, prints
what was fetched and the coverage, and cleans everything up, even on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cachecd.cli_help import count
from cachecd.sizes import format_size

REPO = "cachecd/tiny-k3"
DEFAULT_PROMPT = "The cache warms to the workload because"


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="stream a tiny K3 through a local hub and a daemon, end to end")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt the demo generates from")
    p.add_argument("--max-tokens", "--max-new", dest="max_new", type=count(1), default=32, help="tokens to generate")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (hub, cache, logs)")
    p.set_defaults(func=run)


def _cli(*args: str, capture: bool = False,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cachecd.cli", *args]
    proc = subprocess.run(cmd, text=True, capture_output=capture,
                          env={**os.environ, **env} if env else None)
    if proc.returncode != 0:
        detail = (proc.stderr or "")[-2000:] if capture else ""
        raise SystemExit(f"demo: `cachecd {' '.join(args)}` failed ({proc.returncode}) {detail}")
    return proc


def _step(text: str) -> None:
    print(f"\n== {text}", flush=True)


class _Hub:
    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "cachecd.cli", "hub", "serve", str(root),
                                      "--port", "0"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)  # its log: noise here
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if "http://" not in line:
            self.stop()
            raise SystemExit(f"demo: the local hub did not start: {line!r}")
        self.url = line[line.index("http://"):].split()[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def _stop_daemon(socket: Path) -> None:
    from cachecd.errors import DaemonUnavailable
    from cachecd_client import Client

    try:
        with Client(socket, timeout=5) as c:
            pid = int(c.health()["pid"])
    except DaemonUnavailable:
        return
    os.kill(pid, signal.SIGTERM)
    for _ in range(200):
        if not socket.exists():
            return
        time.sleep(0.05)


def run(args: argparse.Namespace) -> int:
    from cachecd.testbed.tiny_model import write_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="cachecd-demo-"))  # under $TMPDIR, as tempfile says
    socket, hub = _socket_path(tmp), None
    try:
        _step("generating a tiny Kimi-K3 checkpoint (the embedded default model)")
        write_tiny_model(tmp / "hub" / REPO)
        hub = _Hub(tmp / "hub")
        print(f"serving it as an HF-compatible hub at {hub.url}")
        _step(f"cachecd setup --stream {REPO}")
        common = ["--socket", str(socket)]
        # Everything the demo makes stays in its temp dir: the daemon's logs, and the settings
        # setup records beside the config file (an empty one of the demo's own, not the user's).
        (tmp / "config.toml").write_text("")
        env = {"CACHECD_LOG_DIR": str(tmp / "logs"), "CACHECD_CONFIG": str(tmp / "config.toml")}
        _cli("setup", "--stream", REPO, "--endpoint", hub.url, *common, "--cache-dir",
             str(tmp / "cache"), "--models-dir", str(tmp / "models"), env=env)
        _step(f"cachecd run --prompt {args.prompt!r} --max-tokens {args.max_new}")
        print("(the tiny model's weights are random numbers, so its text is gibberish: what the "
              "demo shows is each expert it routes to, streamed from the hub, verified, cached)",
              flush=True)
        _cli("run", "--model", REPO, "--prompt", args.prompt, "--max-tokens", str(args.max_new),
             *common, env=env)
        _step("what the daemon fetched")
        _summary(socket)
    finally:
        _stop_daemon(socket)
        if hub is not None:
            hub.stop()
        if socket.parent.parent != tmp:  # the short dir made for a long TMPDIR
            shutil.rmtree(socket.parent, ignore_errors=True)
        if args.keep:
            print(f"\nkept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


# A Unix socket's path has a length limit (104 bytes on macOS, 108 on Linux), the data socket's
# ".data" included.
_SOCKET_PATH_MAX = 104


def _socket_path(tmp: Path) -> Path:
    """The daemon's socket under ``tmp``, or in a short dir of its own under /tmp when $TMPDIR is
    too deep for a socket's path (said on stdout)."""
    socket = tmp / "run" / "cachecd.sock"
    if len(os.fsencode(str(socket) + ".data")) < _SOCKET_PATH_MAX:
        return socket
    short = Path(tempfile.mkdtemp(prefix="cachecd-", dir="/tmp"))
    print(f"$TMPDIR is too deep for a Unix socket's path: the daemon's socket goes in {short}")
    return short / "cachecd.sock"


def _summary(socket: Path) -> None:
    from cachecd_client import Client

    with Client(socket) as c:
        status, cov = c.stats(), c.coverage(REPO)
    counters = status["counters"]
    print(f"expert requests {counters.get('expert_requests', 0)}: hits {counters.get('expert_hits', 0)}, "
          f"misses {counters.get('expert_misses', 0)}; fetched {counters.get('fetched_experts', 0)} experts "
          f"({format_size(counters.get('fetched_bytes', 0))}) with "
          f"{status['upstream'].get('requests_range', 0)} range requests")
    print(f"coverage: {cov['experts_cached']}/{cov['experts_total']} experts, "
          f"{format_size(cov['bytes_cached'])} of {format_size(cov['bytes_total'])}")
    for layer in cov["layers"]:
        bar = "#" * round(20 * layer["experts_cached"] / max(1, layer["experts_total"]))
        print(f"  layer {layer['layer']:>3} {layer['experts_cached']:>4}/{layer['experts_total']:<4} {bar}")
    print(json.dumps({"experts_cached": cov["experts_cached"], "experts_total": cov["experts_total"]}))
