"""`cachecd service` as a Mac user runs it: simulated here, real on a Mac (tests marked ``macos``).

The simulated runs are the real command line with ``sys.platform`` set to "darwin" before cachecd
loads (``tests/simulated_darwin.py``), HOME in a temp dir and --dry-run: the default paths under
~/Library, the launchd agent it would write and the launchctl commands it would run, as a Mac
would get them. The ``macos`` tests load a real agent into the user's GUI domain under a separate
instance name, so the user's own service is never touched.
"""

from __future__ import annotations

import os
import plistlib
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cachecd.daemon.peer import unix_path_limit
from tests.functional.test_service import _health_pid, _wait_pid, clean_env, cli, files_under, home
from tests.harness import short_tmp

__all__ = ["home"]  # the fixture, shared with test_service
REPO_ROOT = Path(__file__).resolve().parents[2]
LABEL = "io.cachecd.daemon"
# On a Mac the simulation would ask the real launchd about the user's own agent; the macos tests
# below run the real thing there.
simulated = pytest.mark.skipif(sys.platform == "darwin", reason="simulates macOS elsewhere")


def as_on_a_mac(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.simulated_darwin", *args], check=False,
                          capture_output=True, text=True, env=env, timeout=120, cwd=REPO_ROOT,
                          stdin=subprocess.DEVNULL)


def mac_env(home: Path) -> dict[str, str]:
    # XDG locations that Linux would use: on macOS the cache and the socket ignore them.
    return clean_env(home, XDG_CACHE_HOME=str(home / "xdg-cache"),
                     XDG_RUNTIME_DIR=str(home / "xdg-run"))


@simulated
def test_install_dry_run_on_a_mac_is_what_launchd_needs(home: Path) -> None:
    proc = as_on_a_mac("service", "install", "--dry-run", env=mac_env(home))
    assert proc.returncode == 0, proc.stderr
    agent = home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    head, _, rest = proc.stdout.partition("\n")
    assert head == (f"# dry run: nothing is changed. launchd file {agent} (would be written):")
    text, end, tail = rest.partition("</plist>\n")
    plist = plistlib.loads((text + end).encode())

    caches, logs = home / "Library" / "Caches" / "cachecd", home / "Library" / "Logs" / "cachecd"
    program = plist["ProgramArguments"]
    assert plist["Label"] == LABEL and Path(program[0]).is_absolute()
    flags = dict(zip(program[program.index("serve") + 1::2], program[program.index("serve") + 2::2],
                     strict=False))
    assert flags["--cache-dir"] == str(caches / "experts")
    assert flags["--models-dir"] == str(caches / "models")
    assert flags["--socket"] == str(caches / "run" / "cachecd.sock")
    assert plist["WorkingDirectory"] == str(caches / "models")
    assert plist["StandardOutPath"] == plist["StandardErrorPath"] == str(logs / "cachecd.log")
    assert plist["EnvironmentVariables"]["CACHECD_CONFIG"] == str(
        home / ".config" / "cachecd" / "config.toml")
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] == {"SuccessfulExit": False}

    lines = tail.splitlines()
    # launchd opens the log file but does not make its directory: install makes it first.
    made = lines[0].removeprefix("# would create if missing: ").split()
    assert made == [str(caches / "experts"), str(caches / "models"), str(caches / "run"), str(logs)]
    uid = os.getuid()
    assert lines[1:] == [
        f"$ launchctl enable gui/{uid}/{plist['Label']}",
        f"$ launchctl bootstrap gui/{uid} {agent}",
        "# note: these commands would fail here: launchctl is not on PATH",
        f"# no daemon answers on {caches / 'run' / 'cachecd.sock'}: nothing running to compare with",
    ]
    assert files_under(home) == []


@simulated
def test_the_default_sockets_fit_macos_sun_path(home: Path) -> None:
    proc = as_on_a_mac("service", "render", env=mac_env(home))
    assert proc.returncode == 0, proc.stderr
    program = plistlib.loads(proc.stdout.encode())["ProgramArguments"]
    sock = program[program.index("--socket") + 1]
    # A 32-character account name, the longest the macOS account dialog allows.
    on_a_mac = "/Users/" + "u" * 32 + sock.removeprefix(str(home))
    assert len((on_a_mac + ".data").encode()) < unix_path_limit("darwin"), on_a_mac


@simulated
def test_logs_and_uninstall_on_a_mac(home: Path) -> None:
    env = mac_env(home)
    logs = as_on_a_mac("service", "logs", "--dry-run", "-n", "7", env=env)
    log = home / "Library" / "Logs" / "cachecd" / "cachecd.log"
    assert logs.returncode == 0 and logs.stdout == f"$ tail -n 7 {log}\n"
    gone = as_on_a_mac("service", "uninstall", "--dry-run", env=env)
    assert gone.returncode == 0 and "nothing to do" in gone.stdout
    agent = home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    assert str(agent) in gone.stdout and files_under(home) == []


# on a Mac ---------------------------------------------------------------------------------------


@pytest.mark.macos("the rendered agent passes `plutil -lint`")
def test_the_rendered_agent_passes_plutil(home: Path) -> None:
    out = home / "out"
    proc = cli("service", "render", "--output", str(out), env=clean_env(home))
    assert proc.returncode == 0, proc.stderr
    lint = subprocess.run(["plutil", "-lint", str(out / f"{LABEL}.plist")], capture_output=True,
                          text=True, timeout=60)
    assert lint.returncode == 0 and lint.stdout.strip().endswith("OK"), lint.stdout + lint.stderr


@pytest.mark.macos("a real launchd agent: install, a second install finds the daemon's pid in "
                   "`launchctl print` and leaves it alone, launchd restarts it after kill -9, "
                   "uninstall boots it out")
def test_round_trip_under_launchd() -> None:
    from cachecd.service.manager import Launchd

    why = Launchd().unavailable()
    if why:
        pytest.skip(f"no launchd GUI domain for this user: {why}")
    base = short_tmp("cdlnd")
    sock = base / "run" / "s.sock"
    instance = "test-" + uuid.uuid4().hex[:8]
    env = {**os.environ, "CACHECD_SERVICE_INSTANCE": instance,
           "CACHECD_CONFIG": str(_empty(base / "empty.toml")), "HF_HUB_DISABLE_TELEMETRY": "1"}
    flags = ["--platform", "launchd", "--cache-dir", str(base / "cache"), "--socket", str(sock),
             "--endpoint", "http://127.0.0.1:9"]
    target = f"gui/{os.getuid()}/{LABEL}.{instance}"
    try:
        first = cli("service", "install", *flags, env=env)
        assert first.returncode == 0, first.stdout + first.stderr
        pid = _wait_pid(sock, None)
        # Install reads the managed pid from `launchctl print`; read wrongly, the daemon would
        # look unmanaged and be stopped.
        again = cli("service", "install", *flags, env=env)
        assert again.returncode == 0 and "unchanged" in again.stdout, again.stdout + again.stderr
        assert "stopping the daemon" not in again.stdout and _health_pid(sock) == pid
        printed = subprocess.run(["launchctl", "print", target], capture_output=True, text=True,
                                 timeout=30)
        assert printed.returncode == 0 and re.search(rf"^\s*pid = {pid}$", printed.stdout, re.M)
        status = cli("service", "status", "--platform", "launchd", env=env)
        assert status.returncode == 0 and f"pid {pid}" in status.stdout, status.stdout
        os.kill(pid, signal.SIGKILL)  # KeepAlive {SuccessfulExit: false} brings it back
        _wait_pid(sock, pid, timeout=60)
        gone = cli("service", "uninstall", "--platform", "launchd", env=env)
        assert gone.returncode == 0, gone.stderr
        assert _health_pid(sock) is None
        assert subprocess.run(["launchctl", "print", target], capture_output=True,
                              timeout=30).returncode != 0
    finally:
        cli("service", "uninstall", "--platform", "launchd", env=env)
        shutil.rmtree(base, ignore_errors=True)


def _empty(path: Path) -> Path:
    """An empty config file: no user config reaches the service (a missing one named by
    CACHECD_CONFIG is an error)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path
