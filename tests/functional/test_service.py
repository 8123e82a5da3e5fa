"""`cachecd service` as a user runs it: CLI subprocesses, real files, systemd-analyze, plistlib.

Everything that would touch the user's service manager runs with HOME in a temp dir and either
--dry-run or a manager made unreachable on purpose. The round trip through a real systemd user
manager runs only where one answers, under a separate instance name so the user's own service
is never touched.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachecd.errors import DaemonUnavailable
from tests.harness import CACHECD, DaemonProcess, short_tmp

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_TOKEN = "hf_" + "Q" * 34
ODD_NAME = 'odd dir 50% $HOME "q"'


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """The caller's environment with HOME moved and nothing that would steer paths elsewhere."""
    drop = ("XDG_", "CACHECD_", "HF_", "DBUS_SESSION_BUS_ADDRESS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def no_manager_env(home: Path, **extra: str) -> dict[str, str]:
    # An empty runtime dir and no session bus: systemctl --user reaches no manager on any machine.
    runtime = home / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    return clean_env(home, XDG_RUNTIME_DIR=str(runtime), **extra)


def cli(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CACHECD, *args], check=False, capture_output=True, text=True,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() or p.is_socket())


@pytest.fixture
def home() -> Iterator[Path]:
    path = short_tmp("cdsvc")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def exec_start_argv(unit_text: str) -> list[str]:
    """ExecStart= as systemd reads it: quotes and escapes, then %% and $$ unescaped."""
    line = next(ln for ln in unit_text.splitlines() if ln.startswith("ExecStart="))
    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(line[len("ExecStart="):])]


def unit_values(unit_text: str, key: str) -> list[str]:
    return [ln.split("=", 1)[1] for ln in unit_text.splitlines() if ln.startswith(key + "=")]


# render: launchd -------------------------------------------------------------------------------


def test_rendered_plist_parses_and_has_what_launchd_needs(home: Path) -> None:
    out, cache = home / "out", home / ODD_NAME / "experts"
    env = clean_env(home, HF_ENDPOINT="http://127.0.0.1:9/hub", HF_TOKEN=FAKE_TOKEN)
    proc = cli("service", "render", "--platform", "launchd", "--output", str(out),
               "--cache-dir", str(cache), "--budget", "2GiB", "--scrub-rate", "1MiB", env=env)
    assert proc.returncode == 0, proc.stderr
    path = out / "io.cachecd.daemon.plist"
    assert proc.stdout.strip() == str(path)
    text = path.read_text()
    plist = plistlib.loads(text.encode())

    assert plist["Label"] == "io.cachecd.daemon"
    program = plist["ProgramArguments"]
    assert Path(program[0]).is_absolute() and os.access(program[0], os.X_OK)
    version = subprocess.run([*program[: program.index("serve")], "--version"],
                             check=False, capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("cachecd "), version
    assert program[program.index("--cache-dir") + 1] == str(cache)
    assert program[program.index("--budget") + 1] == str(2 << 30)
    assert program[program.index("--scrub-rate") + 1] == str(1 << 20)
    assert program[program.index("--endpoint") + 1] == "http://127.0.0.1:9/hub"
    assert Path(program[program.index("--socket") + 1]).is_absolute()
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ProcessType"] == "Standard"  # no I/O throttling of the daemon
    assert plist["ThrottleInterval"] > 0 and plist["ExitTimeOut"] > 10
    logs = home / "Library" / "Logs" / "cachecd"
    assert Path(plist["StandardErrorPath"]).parent == logs
    assert Path(plist["StandardOutPath"]).parent == logs
    assert plist["EnvironmentVariables"]["HF_ENDPOINT"] == "http://127.0.0.1:9/hub"
    assert plist["EnvironmentVariables"]["CACHECD_CONFIG"] == str(
        home / ".config" / "cachecd" / "config.toml")
    assert Path(plist["WorkingDirectory"]).is_absolute()
    # A token never goes into a service file; the user is told how the service will find one.
    assert FAKE_TOKEN not in text + proc.stdout + proc.stderr
    assert "HF_TOKEN" not in plist["EnvironmentVariables"] and "hf auth login" in proc.stderr


# render: systemd -------------------------------------------------------------------------------


def systemd_verify(unit: Path, runtime: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install -y systemd)")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_LOG_COLOR": "0"}
    return subprocess.run(["systemd-analyze", "--user", "verify", str(unit)], check=False,
                          capture_output=True, text=True, env=env, timeout=60)


def test_proxy_variables_reach_the_service_but_never_credentials(home: Path) -> None:
    env = clean_env(home, HTTPS_PROXY="http://proxy.example:3128", no_proxy="localhost,.lan",
                    http_proxy="http://me:hunter2@proxy.example:3128")
    seen = {}
    for platform in ("systemd", "launchd"):
        proc = cli("service", "render", "--platform", platform, env=env)
        assert proc.returncode == 0, proc.stderr
        assert "hunter2" not in proc.stdout + proc.stderr
        assert "note: http_proxy carries credentials" in proc.stderr, proc.stderr
        seen[platform] = proc.stdout
    plist = plistlib.loads(seen["launchd"].encode())["EnvironmentVariables"]
    unit = dict(line.removeprefix("Environment=").split("=", 1)
                for line in seen["systemd"].splitlines() if line.startswith("Environment="))
    for env_of_service in (plist, unit):
        assert env_of_service["HTTPS_PROXY"] == "http://proxy.example:3128"
        assert env_of_service["no_proxy"] == "localhost,.lan" and "http_proxy" not in env_of_service


def test_rendered_unit_passes_systemd_analyze_verify(home: Path) -> None:
    out, cache = home / "out", home / ODD_NAME / "experts"
    sock = home / "run" / "s.sock"
    proc = cli("service", "render", "--platform", "systemd", "--output", str(out),
               "--cache-dir", str(cache), "--socket", str(sock), env=clean_env(home))
    assert proc.returncode == 0, proc.stderr
    unit = out / "cachecd.service"
    text = unit.read_text()
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644  # readable by the service manager
    assert [p.name for p in out.iterdir()] == ["cachecd.service"]  # no temp file left beside it
    runtime = home / "rt"
    runtime.mkdir(mode=0o700)
    check = systemd_verify(unit, runtime)
    assert check.returncode == 0 and check.stderr.strip() == "", check.stderr

    argv = exec_start_argv(text)
    assert os.access(argv[0], os.X_OK) and argv[argv.index("serve") + 1] == "--cache-dir"
    assert argv[argv.index("--cache-dir") + 1] == str(cache)
    assert argv[argv.index("--socket") + 1] == str(sock)
    rw = shlex.split(unit_values(text, "ReadWritePaths")[0].replace("%%", "%"))
    assert rw == [str(cache), str(home / ODD_NAME / "models"), str(sock.parent)]
    # READY=1 once recovery is done and the sockets accept (tests/functional/test_notify.py).
    for key, value in (("Type", "notify"), ("NotifyAccess", "main"), ("Restart", "on-failure"),
                       ("KillSignal", "SIGTERM"),
                       ("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("ProtectHome", "read-only"),
                       ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
                       ("PrivateTmp", "no")):  # the socket is under /tmp: clients must see it
        assert unit_values(text, key) == [value], key
    assert int(unit_values(text, "TimeoutStopSec")[0]) > 10  # the daemon's drain timeout

    # The same check fails on a unit whose ExecStart does not exist: the verify step can fail.
    broken = out / "broken.service"
    broken.write_text(text.replace(f"ExecStart={argv[0]}", "ExecStart=/nonexistent/cachecd"))
    assert systemd_verify(broken, runtime).returncode != 0


def test_private_tmp_is_on_when_no_path_is_under_tmp(home: Path) -> None:
    proc = cli("service", "render", "--platform", "systemd", "--cache-dir", "/srv/cd/experts",
               "--socket", "/run/user/4242/cachecd/cachecd.sock", env=clean_env(home))
    assert proc.returncode == 0, proc.stderr
    assert unit_values(proc.stdout, "PrivateTmp") == ["yes"]
    assert unit_values(proc.stdout, "ReadWritePaths") == [
        "/srv/cd/experts /srv/cd/models /run/user/4242/cachecd"]


def test_the_templates_ship_as_package_data(tmp_path: Path) -> None:
    """A built (non-editable) tree holds the templates and renders from them."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("cachecd", "client", "engine", "manifests", "systemd-launchd"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        if (REPO_ROOT / name).exists():
            shutil.copy(REPO_ROOT / name, src / name)
    build = tmp_path / "lib"
    subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q",
                    "build_py", "--build-lib", str(build)], cwd=src, check=True,
                   capture_output=True, timeout=120)
    shipped = {p.name for p in (build / "cachecd_service_templates").iterdir()}
    assert {"cachecd.service", "io.cachecd.daemon.plist", "README.md"} <= shipped
    env = {**clean_env(tmp_path), "PYTHONPATH": str(build)}
    probe = subprocess.run(
        [sys.executable, "-c", ("import cachecd, cachecd_service_templates as t; "
                                "print(cachecd.__file__); print(t.__file__)")],
        capture_output=True, text=True, env=env, timeout=60, check=True, cwd=tmp_path)
    assert all(line.startswith(str(build)) for line in probe.stdout.split())
    rendered = subprocess.run([sys.executable, "-m", "cachecd.cli", "service", "render",
                               "--platform", "systemd"], check=False, capture_output=True,
                              text=True, env=env, timeout=60, cwd=tmp_path)
    assert rendered.returncode == 0 and "ExecStart=" in rendered.stdout, rendered.stderr


# install / uninstall / status / logs without touching a manager ---------------------------------


@pytest.mark.parametrize("platform", ["systemd", "launchd"])
def test_install_dry_run_prints_the_file_and_commands_and_changes_nothing(
    home: Path, platform: str
) -> None:
    proc = cli("service", "install", "--platform", platform, "--dry-run", env=clean_env(home))
    assert proc.returncode == 0, proc.stderr
    if platform == "systemd":
        unit = home / ".config" / "systemd" / "user" / "cachecd.service"
        assert f"{unit} (would be written)" in proc.stdout and "ExecStart=" in proc.stdout
        for cmd in ("systemctl --user daemon-reload",
                    "systemctl --user enable --now cachecd.service"):
            assert f"\n$ {cmd}\n" in proc.stdout
    else:
        plist = home / "Library" / "LaunchAgents" / "io.cachecd.daemon.plist"
        assert "<key>ProgramArguments</key>" in proc.stdout
        assert f"\n$ launchctl bootstrap gui/{os.getuid()} {plist}\n" in proc.stdout
    assert files_under(home) == []


def test_install_without_a_manager_fails_clearly_and_writes_nothing(home: Path) -> None:
    platform = "systemd" if sys.platform != "darwin" else "launchd"
    proc = cli("service", "install", "--platform", platform, env=no_manager_env(home))
    assert proc.returncode == 1
    assert "service_manager_unavailable" in proc.stderr and "`cachecd serve`" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert files_under(home) == []


@pytest.mark.skipif(sys.platform == "darwin", reason="launchd is this machine's manager")
def test_launchd_install_off_macos_says_so(home: Path) -> None:
    proc = cli("service", "install", "--platform", "launchd", env=clean_env(home))
    assert proc.returncode == 1 and "launchd is macOS's service manager" in proc.stderr


@pytest.mark.parametrize("platform", ["systemd", "launchd"])
def test_uninstall_when_absent_succeeds_with_a_note(home: Path, platform: str) -> None:
    proc = cli("service", "uninstall", "--platform", platform, env=no_manager_env(home))
    assert proc.returncode == 0 and "nothing to do" in proc.stdout


def test_uninstall_dry_run_keeps_the_file_and_a_real_one_removes_it(home: Path) -> None:
    unit_dir = home / ".config" / "systemd" / "user"
    env = no_manager_env(home)
    assert cli("service", "render", "--platform", "systemd", "--output", str(unit_dir),
               env=env).returncode == 0
    unit = unit_dir / "cachecd.service"
    dry = cli("service", "uninstall", "--platform", "systemd", "--dry-run", env=env)
    assert dry.returncode == 0 and f"would remove {unit}" in dry.stdout and unit.exists()
    real = cli("service", "uninstall", "--platform", "systemd", env=env)
    assert real.returncode == 0, real.stderr
    assert not unit.exists() and "only the file is removed" in real.stderr


def test_status_reads_the_installed_socket_and_asks_the_daemon(home: Path) -> None:
    env = no_manager_env(home)
    sock = short_tmp("cdsvs") / "run" / "s.sock"
    unit_dir = home / ".config" / "systemd" / "user"
    assert cli("service", "render", "--platform", "systemd", "--output", str(unit_dir),
               "--socket", str(sock), env=env).returncode == 0
    down = cli("service", "status", "--platform", "systemd", env=env)
    assert down.returncode == 3 and f"not answering on {sock}" in down.stdout
    assert "(installed)" in down.stdout and "systemd unavailable" in down.stdout
    daemon = DaemonProcess("http://127.0.0.1:9", socket=sock).start()
    try:
        up = cli("service", "status", "--platform", "systemd", env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"pid {daemon.proc.pid}" in up.stdout and str(sock) in up.stdout
    finally:
        daemon.cleanup()
        shutil.rmtree(sock.parent.parent, ignore_errors=True)


def test_install_dry_run_names_a_daemon_running_outside_the_manager(home: Path) -> None:
    daemon = DaemonProcess("http://127.0.0.1:9").start()
    try:
        proc = cli("service", "install", "--platform", "systemd", "--dry-run", "--socket",
                   str(daemon.socket), "--cache-dir", str(daemon.cache_dir),
                   env=no_manager_env(home))
        assert proc.returncode == 0, proc.stderr
        assert f"would stop pid {daemon.proc.pid} (SIGTERM" in proc.stdout
        assert "these commands would fail here" in proc.stdout
        with daemon.client(timeout=5) as c:  # dry run: still running
            assert c.health()["ok"]
    finally:
        daemon.cleanup()


@pytest.mark.parametrize("platform", ["systemd", "launchd"])
def test_logs_dry_run_prints_the_command(home: Path, platform: str) -> None:
    proc = cli("service", "logs", "--platform", platform, "--dry-run", "-n", "7",
               env=clean_env(home))
    assert proc.returncode == 0
    if platform == "systemd":
        assert proc.stdout == "$ journalctl --user --unit cachecd.service --lines 7 --no-pager\n"
    else:
        log = home / "Library" / "Logs" / "cachecd" / "cachecd.log"
        assert proc.stdout == f"$ tail -n 7 {log}\n"


# a real systemd user manager -------------------------------------------------------------------


def user_manager_state() -> str:
    if shutil.which("systemctl") is None:
        return "systemctl is not installed"
    proc = subprocess.run(["systemctl", "--user", "is-system-running"], check=False,
                          capture_output=True, text=True, timeout=30)
    state = proc.stdout.strip()
    if state in ("running", "degraded"):
        return ""
    said = "; ".join(filter(None, (state, proc.stderr.strip()))) or "nothing"
    return f"`systemctl --user is-system-running` says {said!r} (exit {proc.returncode})"


def _health_pid(sock: Path) -> int | None:
    from cachecd_client import Client

    try:
        with Client(sock, timeout=5) as c:
            return int(c.health()["pid"])
    except DaemonUnavailable:
        return None


def _wait_pid(sock: Path, not_pid: int | None, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = _health_pid(sock)
        if pid and pid != not_pid:
            return pid
        time.sleep(0.2)
    raise AssertionError(f"no daemon other than {not_pid} answered on {sock} in {timeout}s")


def test_round_trip_under_a_real_systemd_user_manager() -> None:
    why = user_manager_state()
    if why:
        pytest.skip(f"no systemd user manager on this machine: {why}")
    base = short_tmp("cdsvr")
    sock = base / "run" / "s.sock"
    instance = "test-" + uuid.uuid4().hex[:8]
    env = {**os.environ, "CACHECD_SERVICE_INSTANCE": instance,
           "CACHECD_CONFIG": str(_empty(base / "empty.toml")), "HF_HUB_DISABLE_TELEMETRY": "1"}
    flags = ["--platform", "systemd", "--cache-dir", str(base / "cache"), "--socket", str(sock),
             "--endpoint", "http://127.0.0.1:9"]
    unit = f"cachecd-{instance}.service"
    try:
        first = cli("service", "install", *flags, env=env)
        assert first.returncode == 0, first.stdout + first.stderr
        pid = _wait_pid(sock, None)
        again = cli("service", "install", *flags, env=env)
        assert again.returncode == 0 and "unchanged" in again.stdout, again.stderr
        assert _health_pid(sock) == pid  # an unchanged install does not bounce the daemon
        status = cli("service", "status", "--platform", "systemd", env=env)
        assert status.returncode == 0 and f"pid {pid}" in status.stdout, status.stdout
        os.kill(pid, signal.SIGKILL)  # Restart=on-failure brings it back
        _wait_pid(sock, pid, timeout=60)
        gone = cli("service", "uninstall", "--platform", "systemd", env=env)
        assert gone.returncode == 0, gone.stderr
        assert _health_pid(sock) is None and not sock.exists()
        state = subprocess.run(["systemctl", "--user", "is-active", unit], check=False,
                               capture_output=True, text=True, timeout=30)
        assert state.stdout.strip() in ("inactive", "unknown"), state.stdout
        assert "nothing to do" in cli("service", "uninstall", "--platform", "systemd",
                                      env=env).stdout
    finally:
        cli("service", "uninstall", "--platform", "systemd", env=env)
        shutil.rmtree(base, ignore_errors=True)


def _empty(path: Path) -> Path:
    """An empty config file: no user config reaches the service (a missing one named by
    CACHECD_CONFIG is an error)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path
