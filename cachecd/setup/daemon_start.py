"""The daemon ``cachecd setup --stream`` registers with: the one running on the socket, or one it
starts (unless ``--no-start``) with the settings setup was given, logging to the platform's log
dir, and waits for until it answers.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cachecd import constants
from cachecd.config import Settings
from cachecd.errors import DaemonUnavailable
from cachecd.service.render import sharing_arguments
from cachecd.setup.lock import held


def ensure_daemon(settings: Settings, args: argparse.Namespace) -> Any:
    """A client of the daemon on the socket: the one answering, else one started now. Setups
    of other models at once ask one at a time (``lock.held``): the second finds the first's."""
    from cachecd_client import Client

    log_path = daemon_log_path(settings.socket)
    client = Client(settings.socket)
    with held(log_path.with_suffix(".start.lock"), "another setup is starting a daemon on "
              f"{settings.socket}"):
        try:
            client.health()
            return client
        except DaemonUnavailable:
            if args.no_start:
                raise
        return _start(settings, client, log_path)


def _start(settings: Settings, client: Any, log_path: Path) -> Any:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "cachecd.cli", "serve", "--socket", str(settings.socket),
           "--endpoint", settings.endpoint, "--models-dir", str(settings.models_dir)]
    for d in settings.cache_dirs:
        cmd += ["--cache-dir", str(d)]
    if settings.budget:
        cmd += ["--budget", str(settings.budget)]
    cmd += sharing_arguments(settings)
    # The daemon rotates its log itself; its stderr (a crash's traceback) starts afresh each start.
    # 0600, as the log itself: only the daemon's user reads what a daemon wrote.
    err_fd = os.open(log_path.with_suffix(".stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(err_fd, 0o600)
    with open(err_fd, "wb") as err:
        proc = subprocess.Popen([*cmd, "--log-file", str(log_path)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    print(f"started a daemon (pid {proc.pid}, log {log_path})")
    print(service_hint(cmd[cmd.index("serve") + 1:]))
    return wait_healthy(client, proc, log_path)


def daemon_log_path(socket: Path) -> Path:
    """Where a daemon this command starts logs: the platform's log dir, one file per socket."""
    if socket == constants.DEFAULT_SOCKET:
        return constants.LOG_DIR / "daemon.log"
    return constants.LOG_DIR / f"daemon-{hashlib.sha256(str(socket).encode()).hexdigest()[:8]}.log"


def service_hint(serve_args: list[str]) -> str:
    """How to keep a daemon running across logins and reboots, or why this machine cannot."""
    import shlex

    from cachecd.service.manager import manager_for

    if manager_for(None).unavailable():  # `cachecd service status` says why, at length
        return ("no service manager here (cachecd service status says why): keep `cachecd "
                "serve` running under your own supervisor")
    return f"to keep it running across reboots: cachecd service install {shlex.join(serve_args)}"


def wait_healthy(client: Any, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "".join(p.read_text(errors="replace")[-2000:] for p in
                           (log_path, log_path.with_suffix(".stderr")) if p.exists())
            raise DaemonUnavailable(f"the daemon exited with {proc.returncode}:\n{tail}")
        try:
            client.health()
            return client
        except DaemonUnavailable:
            time.sleep(0.05)
    raise DaemonUnavailable(f"the daemon did not answer within {timeout:.0f}s; see {log_path}")
