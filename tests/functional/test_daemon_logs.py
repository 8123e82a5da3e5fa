"""What `cachecd setup --stream` prints, and where the daemon it starts logs.

Setup runs with its stderr on a terminal (a pty), where progress bars draw: with
HF_HUB_DISABLE_PROGRESS_BARS=1 there is none, and no log line sits between its messages. The
daemon it starts logs in the platform's log dir (XDG_STATE_HOME here), rotated by size.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import CACHECD, TINY_REPO, DaemonProcess, HubProcess, Installed, short_tmp


@pytest.fixture
def base() -> Iterator[Path]:
    path = short_tmp("cdl")
    yield path
    Installed(path).cleanup()


def on_a_terminal(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run ``argv`` with its stderr on a pty; its exit code, stdout and what the terminal got."""
    main, sub = pty.openpty()
    # A terminal of 24 x 100: without a size tqdm draws its bar zero columns wide.
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=sub, stdin=subprocess.DEVNULL,
                            env=env, text=True)
    os.close(sub)
    seen = bytearray()
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(main)
    out = proc.stdout.read() if proc.stdout else ""
    return proc.wait(60), out, seen.decode(errors="replace")


@pytest.mark.skipif(sys.platform == "darwin", reason="the XDG_STATE_HOME log dir is Linux's")
def test_setup_is_quiet_and_the_daemon_logs_in_the_state_dir(
        hub: HubProcess, tiny_manifest_path: Path, base: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CACHECD_LOG_DIR"}
    env.update(HF_HUB_DISABLE_PROGRESS_BARS="1", XDG_STATE_HOME=str(base / "state"),
               HF_HOME=str(base / "hf"))
    code, out, terminal = on_a_terminal(
        [*CACHECD, "setup", "--stream", TINY_REPO, "--endpoint", hub.url, "--manifest",
         str(tiny_manifest_path), "--socket", str(base / "run" / "s.sock"), "--cache-dir",
         str(base / "cache"), "--models-dir", str(base / "models")], env)
    assert code == 0 and "installed" in out, (out, terminal)
    # No bar: tqdm redraws with a bare \r (the terminal shows each newline as \r\n).
    assert "resident weights" not in terminal and not re.search("\r(?!\n)", terminal), terminal
    assert not re.search(r" (DEBUG|INFO) ", terminal), terminal
    log = Path(re.search(r"started a daemon \(pid \d+, log (\S+)\)", out)[1])  # type: ignore[index]
    assert log.parent == base / "state" / "cachecd" and log.name.endswith(".log")
    assert "listening socket=" in log.read_text()
    assert "serving on" in log.with_suffix(".stderr").read_text()
    assert not list((base / "models").rglob("*.log"))


def test_the_daemon_log_rotates_by_size(hub: HubProcess, tiny_manifest_path: Path) -> None:
    logs = short_tmp("cdr")
    log = logs / "daemon.log"
    d = DaemonProcess(hub.url, args=["--offline", "--log-file", str(log), "--log-max-bytes",
                                     "2KiB"]).start()
    try:
        with d.client() as c:  # each registration logs two lines (~320 bytes) offline
            for _ in range(30):
                c.register(tiny_manifest_path)
        files = sorted(p.name for p in logs.iterdir())
        assert files == ["daemon.log", "daemon.log.1", "daemon.log.2", "daemon.log.3"], files
        assert all((logs / f).stat().st_size <= 2048 for f in files)
        text = "".join((logs / f).read_text() for f in files)
        assert "model registered" in text and "listening socket=" not in text  # oldest dropped
        assert "model registered" not in d.log()  # nothing of the log on stderr
    finally:
        d.cleanup()
        shutil.rmtree(logs, ignore_errors=True)
