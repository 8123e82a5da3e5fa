"""``cachecd stop``: stop the daemon on a socket as a service manager would, gracefully.

The daemon names its own pid (``/healthz``); the command sends that pid SIGTERM (the daemon drains
its fetches in flight for up to its ``shutdown_timeout``, closes the cache, removes its sockets
and exits 0) and waits for the process to be gone. It never signals a pid it did not just read
from the daemon on the socket, and sends nothing stronger than SIGTERM: a daemon still running
after ``--wait`` is reported, not killed. A daemon run by launchd or systemd stays down after it
(both restart only after a crash or a non-zero exit).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from cachecd.cli_help import number
from cachecd.config import add_common_arguments, load_settings
from cachecd.errors import DaemonUnavailable, StopTimedOut

_EXTRA_WAIT_S = 20.0  # past the daemon's drain timeout, as the service templates allow
_POLL_S = 0.05


def register(sub: Any) -> None:
    p = sub.add_parser("stop", help="stop the daemon (it drains fetches in flight, then exits)")
    add_common_arguments(p)
    p.add_argument("--wait", type=number(0), metavar="SECONDS",
                   help="how long to wait for it to exit (default: the drain timeout, "
                        "shutdown_timeout, + 20 s)")
    p.set_defaults(func=stop)


def stop(args: argparse.Namespace) -> int:
    from cachecd_client import Client

    settings = load_settings()
    socket = Path(args.socket) if args.socket else settings.socket
    wait = args.wait if args.wait is not None else settings.shutdown_timeout + _EXTRA_WAIT_S
    try:
        with Client(socket, timeout=10) as client:
            pid = int(client.health()["pid"])
    except DaemonUnavailable:
        raise DaemonUnavailable(f"no daemon answers on {socket}: nothing to stop") from None
    print(f"stopping the daemon on {socket} (pid {pid}): it finishes the fetches in flight",
          flush=True)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # it stopped between the answer and the signal: what was asked
    if not _gone_within(pid, wait):
        raise StopTimedOut(
            f"the daemon on {socket} (pid {pid}) is still running {wait:g}s after SIGTERM; "
            f"its log says what it waits on: wait longer (cachecd stop --wait SECONDS), or "
            f"`kill -9 {pid}` (fetches in flight are dropped; the cache stays consistent)")
    print("stopped", flush=True)
    return 0


def _gone_within(pid: int, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while _alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _alive(pid: int) -> bool:
    """The process exists and has not exited (an exited one nobody reaped yet, a zombie, is
    gone for this purpose: on Linux /proc says so)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if sys.platform.startswith("linux"):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True
