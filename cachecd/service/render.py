"""Render the launchd agent and the systemd user unit from the shipped templates.

Invariants: a rendered file names only absolute paths (the interpreter or console script, the
cache dirs, the models dir, the socket) so the service does not depend on the installing shell's
PATH or working directory; every value is escaped for its format (XML for the plist; quotes,
``%`` specifiers and ``$`` variables for systemd), and a value that cannot be represented (a
newline, a NUL) is refused rather than written; no token is ever written (the service reads
huggingface_hub's token file).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from string import Template
from urllib.parse import urlsplit
from xml.sax.saxutils import escape as xml_escape

from cachecd import constants
from cachecd.config import Settings
from cachecd.errors import ConfigInvalid

TEMPLATE_PACKAGE = "cachecd_service_templates"
SYSTEMD_TEMPLATE = "cachecd.service"
LAUNCHD_TEMPLATE = "io.cachecd.daemon.plist"
# Margin on top of the daemon's own drain before the manager sends SIGKILL.
STOP_MARGIN_S = 20
# Standard, not Adaptive/Background: launchd throttles the disk I/O of background jobs, and the
# daemon's whole job is disk I/O on the engine's critical path.
PROCESS_TYPE = "Standard"
_SHARED_TMP = (Path("/tmp"), Path("/var/tmp"))


@dataclass(frozen=True)
class ServiceSpec:
    """Everything a service file says about the daemon, independent of the manager."""

    program: list[str]
    environment: dict[str, str]
    working_directory: Path
    writable_dirs: list[Path]
    socket: Path
    log_file: Path
    shutdown_timeout: float
    label: str = constants.SERVICE_LABEL
    notes: list[str] = field(default_factory=list)

    @property
    def timeout_stop(self) -> int:
        return int(self.shutdown_timeout) + STOP_MARGIN_S


def template_text(name: str) -> str:
    """A template from the installed package (works from a wheel, not only a checkout)."""
    return resources.files(TEMPLATE_PACKAGE).joinpath(name).read_text(encoding="utf-8")


def daemon_program() -> list[str]:
    """The console script beside this interpreter, else ``python -m cachecd.cli``.

    The venv's ``bin/python`` is kept as is (not resolved): resolving the symlink would lose the
    venv and its packages.
    """
    python = os.path.abspath(sys.executable)
    script = Path(python).parent / constants.APP
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [python, "-m", "cachecd.cli"]


def serve_arguments(settings: Settings, explicit: dict[str, object]) -> list[str]:
    """``serve`` flags: the resolved paths and endpoint always, other settings when given."""
    argv = ["serve"]
    for d in settings.cache_dirs:
        argv += ["--cache-dir", str(d.absolute())]
    argv += ["--models-dir", str(settings.models_dir.absolute()),
             "--socket", str(settings.socket.absolute()), "--endpoint", settings.endpoint]
    if explicit.get("budget") is not None:
        argv += ["--budget", str(settings.budget)]
    if explicit.get("policy") is not None:
        argv += ["--policy", settings.policy]
    if explicit.get("max_parallel") is not None:
        argv += ["--max-parallel", str(settings.max_parallel)]
    if explicit.get("offline"):
        argv.append("--offline")
    if explicit.get("scrub_rate") is not None:
        argv += ["--scrub-rate", str(settings.scrub_rate)]
    for m in settings.manifests if explicit.get("manifests") else []:
        argv += ["--manifest", str(Path(m).absolute())]
    return argv + sharing_arguments(settings)


def sharing_arguments(settings: Settings) -> list[str]:
    """The --share and --peer flags of ``serve`` for what the settings name (config, env)."""
    argv: list[str] = []
    if settings.share:
        argv += ["--share", settings.share]
        if settings.share_token_file:
            argv += ["--share-token-file", str(Path(settings.share_token_file).absolute())]
    for url in settings.peers:
        argv += ["--peer", url]
    if settings.peers and settings.peer_token_file:
        argv += ["--peer-token-file", str(Path(settings.peer_token_file).absolute()),
                 "--peer-deadline", str(settings.peer_deadline),
                 "--peer-min-rate", str(settings.peer_min_rate)]
    return argv


def _has_credentials(url: str) -> bool:
    """``http://user:secret@proxy:3128`` (or a token as the user name) -> True; a proxy without
    credentials, or a NO_PROXY list, -> False."""
    return "@" in urlsplit(url if "://" in url else f"//{url}").netloc


def build_spec(settings: Settings, explicit: dict[str, object], log_file: Path) -> ServiceSpec:
    socket_dir = settings.socket.absolute().parent
    writable = _unique([*(d.absolute() for d in settings.cache_dirs),
                        settings.models_dir.absolute(), socket_dir])
    env = {**constants.SERVICE_ENV, "CACHECD_CONFIG": str(constants.ACTIVE_CONFIG_FILE.absolute()),
           "PYTHONUNBUFFERED": "1"}
    notes = []
    kept_out = sorted(k for k in constants.SERVICE_PROXY_KEYS
                      if k in env and _has_credentials(env[k]))
    for k in kept_out:
        del env[k]
    if kept_out:
        notes.append(f"{', '.join(kept_out)} carries credentials, which are never written into a "
                     "service file: set it in the service manager yourself (a systemd drop-in "
                     "with Environment=, or EnvironmentVariables in the agent's plist)")
    if constants.HF_TOKEN_IN_ENV and not Path(constants.HF_TOKEN_PATH).exists():
        notes.append("HF_TOKEN is set in this shell, but a token is never written into a service "
                     f"file and {constants.HF_TOKEN_PATH} does not exist: run `hf auth login` so "
                     "the service can read gated repos")
    spec = ServiceSpec(
        program=[*daemon_program(), *serve_arguments(settings, explicit)],
        environment=env, working_directory=settings.models_dir.absolute(),
        writable_dirs=writable, socket=settings.socket.absolute(), log_file=log_file,
        shutdown_timeout=settings.shutdown_timeout, notes=notes)
    for value in [*spec.program, *spec.environment.values(), *spec.environment]:
        _check_representable(value)
    return spec


def _unique(paths: list[Path]) -> list[Path]:
    seen: dict[Path, None] = {}
    for p in paths:
        seen.setdefault(p, None)
    return list(seen)


def _check_representable(value: str) -> None:
    if any(ch in value for ch in "\n\r\0"):
        raise ConfigInvalid(f"{value!r}: a newline or NUL cannot go into a service file")


# systemd -------------------------------------------------------------------------------------


def _systemd_word(word: str, *, exec_line: bool) -> str:
    """One word of an ExecStart=/ReadWritePaths= list, quoted when it needs it."""
    word = word.replace("%", "%%")
    if exec_line:
        word = word.replace("$", "$$")
    if word and not any(ch in word for ch in " \t\"'\\;"):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _systemd_exec(argv: list[str]) -> str:
    return " ".join(_systemd_word(a, exec_line=True) for a in argv)


def _under_shared_tmp(path: Path) -> bool:
    return any(path == t or t in path.parents for t in _SHARED_TMP)


def render_systemd(spec: ServiceSpec) -> str:
    mkdir = shutil.which("mkdir") or "/bin/mkdir"
    env_lines = [f"Environment={_systemd_word(f'{k}={v}', exec_line=False)}"
                 for k, v in spec.environment.items()]
    writable = [str(p) for p in spec.writable_dirs]
    return Template(template_text(SYSTEMD_TEMPLATE)).substitute(
        mkdir_command=_systemd_exec([mkdir, "-p", *writable]),
        exec_start=_systemd_exec(spec.program),
        working_directory=str(spec.working_directory).replace("%", "%%"),
        environment="\n".join(env_lines),
        shutdown_timeout=f"{spec.shutdown_timeout:g}",
        timeout_stop=spec.timeout_stop,
        writable_paths=" ".join(_systemd_word(p, exec_line=False) for p in writable),
        private_tmp="no" if any(_under_shared_tmp(p) for p in spec.writable_dirs) else "yes",
    )


# launchd -------------------------------------------------------------------------------------


def _plist_string(value: str, indent: str) -> str:
    return f"{indent}<string>{xml_escape(value)}</string>"


def render_launchd(spec: ServiceSpec) -> str:
    args = "\n".join(_plist_string(a, "\t\t") for a in spec.program)
    env = "\n".join(f"\t\t<key>{xml_escape(k)}</key>\n{_plist_string(v, chr(9) * 2)}"
                    for k, v in spec.environment.items())
    return Template(template_text(LAUNCHD_TEMPLATE)).substitute(
        label=xml_escape(spec.label),
        program_arguments=args,
        environment=env,
        working_directory=xml_escape(str(spec.working_directory)),
        timeout_stop=spec.timeout_stop,
        process_type=PROCESS_TYPE,
        log_file=xml_escape(str(spec.log_file)),
    )
