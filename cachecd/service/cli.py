"""``cachecd service render|install|uninstall|status|logs``: the daemon under launchd or systemd.

Invariants: ``--dry-run`` changes nothing (it may ask the manager read-only questions) and prints
the file and the exact commands a real run executes, and for install what differs from the
daemon running on the unit's socket (``differ``); install and uninstall are idempotent
(install twice leaves the same file and one running daemon, uninstall when absent succeeds with a
note); a daemon started outside the manager on the same socket (``cachecd setup --stream`` starts
one) is stopped with SIGTERM, so it drains, before the managed one starts; nothing is written or
run when the manager is unavailable.
"""

from __future__ import annotations

import argparse
import os
import plistlib
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cachecd.durable import write_atomic
from cachecd.errors import (
    CachecdError,
    DaemonUnavailable,
    ServiceCommandFailed,
    ServiceManagerUnavailable,
)
from cachecd.service.differ import describe
from cachecd.service.manager import Command, Launchd, Manager, manager_for
from cachecd.service.render import ServiceSpec, build_spec

_EXPLICIT_KEYS = ("budget", "policy", "max_parallel", "offline", "manifests", "scrub_rate")
_INSTEAD = ("run `cachecd serve` in the foreground under your own supervisor (a container's "
            "entrypoint, supervisord, tmux), or write the file with `cachecd service render "
            "--platform {name} --output DIR` and load it yourself")


def register(sub: Any) -> None:
    from cachecd.daemon.serve import add_daemon_arguments

    p = sub.add_parser("service", help="run the daemon under launchd or systemd")
    p.set_defaults(func=lambda _args: _usage(p))
    actions = p.add_subparsers(dest="service_command", metavar="ACTION")
    r = actions.add_parser("render", help="write the launchd plist or systemd unit, filled in")
    r.add_argument("--output", metavar="DIR", help="directory to write to (default: stdout)")
    i = actions.add_parser("install", help="render, install and start the service")
    i.add_argument("--wait", type=float, default=60.0, metavar="S",
                   help="seconds to wait for the daemon to answer (0: do not wait)")
    for q, func in ((r, render), (i, install)):
        _common(q, dry_run=q is i)
        add_daemon_arguments(q)
        q.set_defaults(func=func)
    u = actions.add_parser("uninstall", help="stop the service and remove its file")
    _common(u)
    u.set_defaults(func=uninstall)
    s = actions.add_parser("status", help="the manager's view and the daemon's own status")
    _common(s)
    s.add_argument("--socket", help="control socket (default: the installed service's)")
    s.set_defaults(func=status)
    g = actions.add_parser("logs", help="the service's log (journalctl or the launchd log file)")
    _common(g)
    g.add_argument("-n", "--lines", type=int, default=100, help="how many of the last lines")
    g.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    g.set_defaults(func=logs)


def _common(p: argparse.ArgumentParser, dry_run: bool = True) -> None:
    p.add_argument("--platform", choices=("launchd", "systemd"),
                   help="service manager (default: launchd on macOS, systemd elsewhere)")
    if dry_run:
        p.add_argument("--dry-run", action="store_true",
                       help="print the file and the commands; change nothing")


def _usage(p: argparse.ArgumentParser) -> int:
    p.print_help()
    return 2


def _prepare(args: argparse.Namespace) -> tuple[Manager, ServiceSpec, str]:
    from cachecd.daemon.serve import settings_from_args

    mgr = manager_for(args.platform)
    explicit = {k: getattr(args, k, None) for k in _EXPLICIT_KEYS}
    spec = build_spec(settings_from_args(args), explicit, mgr.log_file())
    for note in spec.notes:
        print(f"cachecd: note: {note}", file=sys.stderr)
    return mgr, spec, mgr.render(spec)


def render(args: argparse.Namespace) -> int:
    mgr, _spec, text = _prepare(args)
    if not args.output:
        sys.stdout.write(text)
        return 0
    out = Path(args.output) / mgr.path.name
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text.encode("utf-8"), mode=0o644)
    print(out)
    return 0


def install(args: argparse.Namespace) -> int:
    mgr, spec, text = _prepare(args)
    reason = mgr.unavailable()
    if reason and not args.dry_run:
        raise ServiceManagerUnavailable(f"{reason}. Instead, {_INSTEAD.format(name=mgr.name)}")
    changed = _read(mgr.path) != text
    loaded = not reason and mgr.is_loaded()
    commands = mgr.install_commands(changed, loaded)
    rogue = _unmanaged_pid(spec.socket, None if reason else mgr.managed_pid())
    if args.dry_run:
        _print_install_plan(mgr, spec, text, changed, rogue, commands, reason)
        from cachecd.daemon.serve import settings_from_args

        print("\n".join(describe(settings_from_args(args), spec.socket)))
        return 0
    _make_dirs(mgr, spec)
    if changed:
        write_atomic(mgr.path, text.encode("utf-8"), mode=0o644)
    print(f"{'wrote' if changed else 'unchanged'} {mgr.path}")
    if rogue:
        _stop_unmanaged(rogue, spec, mgr.name)
    _run_all(commands)
    return _wait_running(mgr, spec, args.wait)


def _print_install_plan(mgr: Manager, spec: ServiceSpec, text: str, changed: bool,
                        rogue: int | None, commands: list[Command], reason: str | None) -> None:
    print(f"# dry run: nothing is changed. {mgr.name} file {mgr.path} "
          f"({'would be written' if changed else 'unchanged'}):")
    print(text, end="" if text.endswith("\n") else "\n")
    dirs = [*spec.writable_dirs, *([spec.log_file.parent] if isinstance(mgr, Launchd) else [])]
    print(f"# would create if missing: {' '.join(shlex.quote(str(d)) for d in dirs)}")
    if rogue:
        print(f"# would stop pid {rogue} (SIGTERM, it drains): a daemon on {spec.socket} that "
              f"{mgr.name} does not manage")
    for cmd in commands:
        print(f"$ {cmd}")
    if reason:
        print(f"# note: these commands would fail here: {reason}")


def uninstall(args: argparse.Namespace) -> int:
    mgr = manager_for(args.platform)
    reason = mgr.unavailable()
    loaded = not reason and mgr.is_loaded()
    if not mgr.path.exists() and not loaded:
        print(f"cachecd service is not installed ({mgr.path} does not exist): nothing to do")
        return 0
    before, after = mgr.uninstall_commands(loaded)
    if reason:
        before, after = [], []
        print(f"cachecd: note: only the file is removed; {reason}", file=sys.stderr)
    if args.dry_run:
        print("# dry run: nothing is changed")
        for cmd in before:
            print(f"$ {cmd}")
        print(f"# would remove {mgr.path}")
        for cmd in after:
            print(f"$ {cmd}")
        return 0
    _run_all(before)
    mgr.path.unlink(missing_ok=True)
    print(f"removed {mgr.path}")
    _run_all(after)
    return 0


def status(args: argparse.Namespace) -> int:
    mgr = manager_for(args.platform)
    installed = mgr.path.exists()
    print(f"service file  {mgr.path} ({'installed' if installed else 'not installed'})")
    reason = mgr.unavailable()
    socket = Path(args.socket) if args.socket else _socket_of(mgr) or _default_socket()
    if args.dry_run:
        print("# dry run: would run")
        print(f"$ {shlex.join(mgr.status_command())}")
        print(f"# and ask the daemon on {socket} for its status")
        return 0
    if reason:
        print(f"manager       {mgr.name} unavailable: {reason}")
    else:
        proc = subprocess.run(mgr.status_command(), check=False, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        print(f"manager       {mgr.name}:")
        print((proc.stdout or proc.stderr).rstrip())
    return _print_daemon_status(socket)


def _print_daemon_status(socket: Path) -> int:
    from cachecd.ctl.cache import render_status
    from cachecd_client import Client

    try:
        with Client(socket, timeout=5) as client:
            info = client.stats()
    except DaemonUnavailable:
        print(f"daemon        not answering on {socket}")
        return 3  # LSB "not running", as systemctl status says it
    print(render_status(info))
    return 0


def logs(args: argparse.Namespace) -> int:
    mgr = manager_for(args.platform)
    argv = mgr.logs_command(args.lines, args.follow)
    if args.dry_run:
        print(f"$ {shlex.join(argv)}")
        return 0
    if isinstance(mgr, Launchd) and not mgr.log_file().exists():
        print(f"no log yet: {mgr.log_file()} does not exist (is the service installed?)")
        return 1
    try:
        return subprocess.run(argv, check=False, stdin=subprocess.DEVNULL).returncode
    except FileNotFoundError:
        raise ServiceManagerUnavailable(
            f"{argv[0]} is not installed; the daemon logs key=value lines to stderr, so run "
            "`cachecd serve` yourself to see them") from None


# helpers ---------------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def _make_dirs(mgr: Manager, spec: ServiceSpec) -> None:
    from cachecd.daemon.peer import ensure_private_dir

    for d in spec.writable_dirs:
        d.mkdir(parents=True, exist_ok=True)
    ensure_private_dir(spec.socket.parent)
    if isinstance(mgr, Launchd):  # launchd opens the log file but does not create its directory
        spec.log_file.parent.mkdir(parents=True, exist_ok=True)


def _run_all(commands: list[Command]) -> None:
    for cmd in commands:
        print(f"$ {cmd}")
        for attempt in range(cmd.retries + 1):
            proc = subprocess.run(cmd.argv, check=False, capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL)
            if proc.returncode == 0 or cmd.may_fail:
                break
            if attempt == cmd.retries:
                detail = (proc.stderr or proc.stdout).strip()
                raise ServiceCommandFailed(f"`{cmd}` exited {proc.returncode}: {detail}")
            time.sleep(1.0)


def _socket_of(mgr: Manager) -> Path | None:
    """The ``--socket`` the installed service was given, so status finds a custom socket."""
    program = installed_program(mgr)
    if program and "--socket" in program[:-1]:
        return Path(program[program.index("--socket") + 1])
    return None


def installed_program(mgr: Manager) -> list[str] | None:
    text = _read(mgr.path)
    if text is None:
        return None
    if isinstance(mgr, Launchd):
        try:
            return [str(a) for a in plistlib.loads(text.encode()).get("ProgramArguments", [])]
        except (plistlib.InvalidFileException, ValueError):
            return None
    for line in text.splitlines():
        if line.startswith("ExecStart="):
            words = shlex.split(line[len("ExecStart="):])
            return [w.replace("$$", "$").replace("%%", "%") for w in words]
    return None


def _default_socket() -> Path:
    from cachecd.config import load_settings

    return load_settings().socket


def _unmanaged_pid(socket: Path, managed: int | None) -> int | None:
    """The pid of a daemon answering on ``socket`` that the manager did not start, if any."""
    pid = _healthy_pid(socket)
    return pid if pid and pid != managed else None


def _stop_unmanaged(pid: int, spec: ServiceSpec, manager: str) -> None:
    print(f"stopping the daemon pid {pid} that runs outside {manager} (SIGTERM; it drains first)")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + spec.timeout_stop
    while time.monotonic() < deadline:
        if _gone(pid):
            return
        time.sleep(0.1)
    raise ServiceCommandFailed(f"pid {pid} still runs {spec.timeout_stop}s after SIGTERM; stop "
                               "it yourself (it holds the cache lock), then install again")


def _gone(pid: int) -> bool:
    """Exited, or exited and not yet reaped by its parent (a zombie holds no lock or socket)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] == "Z"


def _wait_running(mgr: Manager, spec: ServiceSpec, wait: float) -> int:
    if wait <= 0:
        print(f"installed; the daemon will listen on {spec.socket}")
        return 0
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not mgr.failed():
        pid = _healthy_pid(spec.socket)
        if pid:
            print(f"cachecd runs under {mgr.name} (pid {pid}), socket {spec.socket}")
            return 0
        time.sleep(0.2)
    state = "failed" if mgr.failed() else f"does not answer after {wait:g}s"
    proc = subprocess.run(mgr.status_command(), check=False, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    print(f"cachecd: the service is installed but the daemon {state} on {spec.socket}:\n"
          f"{(proc.stdout or proc.stderr).rstrip()}\nsee `cachecd service logs`",
          file=sys.stderr)
    return 1


def _healthy_pid(socket: Path) -> int | None:
    from cachecd_client import Client

    try:
        with Client(socket, timeout=5) as client:
            health = client.health()
    except CachecdError:
        return None
    return int(health.get("pid") or 0) or None if health.get("ok") else None
