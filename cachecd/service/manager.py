"""The two service managers cachecd installs into: a systemd user manager and launchd.

Each backend only *describes* what to do: where the file goes, which commands install, remove,
show and tail it, and how to ask the manager about the daemon. ``service.cli`` runs or prints
those commands, so ``--dry-run`` shows exactly what a real run executes. Queries (is it loaded,
which pid) are read-only and may run during a dry run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cachecd import constants
from cachecd.errors import ConfigInvalid
from cachecd.service.render import ServiceSpec, render_launchd, render_systemd

# States in which `systemctl --user` reaches a working manager.
_SYSTEMD_UP = ("running", "degraded", "starting", "initializing", "maintenance")
_QUERY_TIMEOUT_S = 15


@dataclass(frozen=True)
class Command:
    argv: list[str]
    may_fail: bool = False  # e.g. reset-failed on a unit that never failed
    retries: int = 0

    def __str__(self) -> str:
        import shlex

        return shlex.join(self.argv)


def query(argv: list[str]) -> subprocess.CompletedProcess[str] | None:
    """Run a read-only query; None when the program is missing."""
    try:
        return subprocess.run(argv, check=False, capture_output=True, text=True,
                              timeout=_QUERY_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return None
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"timed out after {_QUERY_TIMEOUT_S}s")


class Systemd:
    name = "systemd"
    unit = constants.SYSTEMD_UNIT

    @property
    def path(self) -> Path:
        return constants.SYSTEMD_USER_DIR / self.unit

    def log_file(self) -> Path:
        return Path("/dev/null")  # journald collects stderr; there is no log file

    def render(self, spec: ServiceSpec) -> str:
        return render_systemd(spec)

    def _ctl(self, *args: str) -> list[str]:
        return ["systemctl", "--user", *args]

    def unavailable(self) -> str | None:
        """Why no user manager can be used here, or None when one answers."""
        if shutil.which("systemctl") is None:
            return "systemctl is not installed, so there is no systemd on this machine"
        proc = query(self._ctl("is-system-running"))
        state = (proc.stdout.strip() if proc else "") or "unknown"
        if proc is not None and state in _SYSTEMD_UP:
            return None
        detail = (proc.stderr.strip() if proc else "") or f"state {state!r}"
        return ("no systemd user manager answers (`systemctl --user is-system-running`: "
                f"{detail}). This is usual in containers and in sessions without a login "
                "manager; on a normal login try `loginctl enable-linger $USER` and set "
                "XDG_RUNTIME_DIR=/run/user/$(id -u)")

    def is_loaded(self) -> bool:
        proc = query(self._ctl("is-active", self.unit))
        return proc is not None and proc.stdout.strip() in ("active", "activating", "reloading")

    def failed(self) -> bool:
        """Given up: the start limit was hit (a crash loop), so waiting longer cannot help."""
        proc = query(self._ctl("is-failed", self.unit))
        return proc is not None and proc.stdout.strip() == "failed"

    def managed_pid(self) -> int | None:
        proc = query(self._ctl("show", "--property=MainPID", "--value", self.unit))
        if proc is None or proc.returncode != 0 or not proc.stdout.strip().isdigit():
            return None
        return int(proc.stdout.strip()) or None

    def install_commands(self, changed: bool, loaded: bool) -> list[Command]:
        cmds = [Command(self._ctl("daemon-reload")),
                Command(self._ctl("reset-failed", self.unit), may_fail=True),
                Command(self._ctl("enable", "--now", self.unit))]
        if changed and loaded:
            cmds.append(Command(self._ctl("restart", self.unit)))
        return cmds

    def uninstall_commands(self, loaded: bool) -> tuple[list[Command], list[Command]]:
        """Commands before the file is removed, and after."""
        before = [Command(self._ctl("disable", "--now", self.unit), may_fail=not loaded)]
        after = [Command(self._ctl("daemon-reload")),
                 Command(self._ctl("reset-failed", self.unit), may_fail=True)]
        return before, after

    def status_command(self) -> list[str]:
        return self._ctl("status", self.unit, "--no-pager", "--lines=10")

    def logs_command(self, lines: int, follow: bool) -> list[str]:
        argv = ["journalctl", "--user", "--unit", self.unit, "--lines", str(lines), "--no-pager"]
        return argv + (["--follow"] if follow else [])


class Launchd:
    name = "launchd"

    @property
    def path(self) -> Path:
        return constants.LAUNCH_AGENTS_DIR / f"{constants.SERVICE_LABEL}.plist"

    def log_file(self) -> Path:
        return constants.LAUNCHD_LOG_DIR / constants.SYSTEMD_UNIT.replace(".service", ".log")

    def render(self, spec: ServiceSpec) -> str:
        return render_launchd(spec)

    @property
    def domain(self) -> str:
        return f"gui/{os.getuid()}"

    @property
    def target(self) -> str:
        return f"{self.domain}/{constants.SERVICE_LABEL}"

    def unavailable(self) -> str | None:
        if sys.platform != "darwin":
            return f"launchd is macOS's service manager and this is {sys.platform}"
        if shutil.which("launchctl") is None:
            return "launchctl is not on PATH"
        proc = query(["launchctl", "print", self.domain])
        if proc is None or proc.returncode != 0:
            return (f"the {self.domain} launchd domain is not available (no GUI login session, "
                    "e.g. over SSH); log in at the console once, or use `sudo launchctl "
                    "bootstrap user/$(id -u) PLIST` with a file from `cachecd service render`")
        return None

    def is_loaded(self) -> bool:
        proc = query(["launchctl", "print", self.target])
        return proc is not None and proc.returncode == 0

    def failed(self) -> bool:
        return False  # launchd keeps retrying every ThrottleInterval; it never gives up

    def managed_pid(self) -> int | None:
        proc = query(["launchctl", "print", self.target])
        if proc is None or proc.returncode != 0:
            return None
        match = re.search(r"^\s*pid = (\d+)", proc.stdout, re.MULTILINE)
        return int(match.group(1)) if match else None

    def install_commands(self, changed: bool, loaded: bool) -> list[Command]:
        cmds = []
        if loaded and changed:
            cmds.append(Command(["launchctl", "bootout", self.target]))
        cmds.append(Command(["launchctl", "enable", self.target]))
        if changed or not loaded:
            # Right after a bootout the old job can still be exiting: bootstrap then fails with
            # an I/O error once or twice.
            cmds.append(Command(["launchctl", "bootstrap", self.domain, str(self.path)], retries=5))
        return cmds

    def uninstall_commands(self, loaded: bool) -> tuple[list[Command], list[Command]]:
        before = [Command(["launchctl", "bootout", self.target])] if loaded else []
        return before, []

    def status_command(self) -> list[str]:
        return ["launchctl", "print", self.target]

    def logs_command(self, lines: int, follow: bool) -> list[str]:
        return ["tail", "-n", str(lines), *(["-F"] if follow else []), str(self.log_file())]


Manager = Systemd | Launchd


def manager_for(platform: str | None) -> Manager:
    """``launchd`` or ``systemd``; the default follows the running OS."""
    if not re.fullmatch(r"[A-Za-z0-9_-]*", constants.SERVICE_INSTANCE):
        raise ConfigInvalid(f"$CACHECD_SERVICE_INSTANCE: {constants.SERVICE_INSTANCE!r} may hold "
                            "only letters, digits, '-' and '_'")
    if platform is None:
        platform = "launchd" if sys.platform == "darwin" else "systemd"
    return Launchd() if platform == "launchd" else Systemd()
