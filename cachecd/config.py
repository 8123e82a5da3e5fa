"""Daemon and client settings: argv > ``CACHECD_*`` environment > what ``cachecd setup`` recorded
> TOML file > constants.

Validated once, at start; a bad value raises ``ConfigInvalid`` naming the key and where it came
from. Besides ``constants``, this is the only module that reads ``os.environ``.

Setup's record (``recorded_path``) is a TOML file of ``RECORDED_KEYS`` only, beside the config
file, one per daemon socket: what setup was told on its command line, so that every later start
of that daemon (a bare ``serve``, ``service render/install``, the next ``setup``) comes back with
it. It outranks the config file because it is the user's latest word; it never names the socket
(it is found by it).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachecd import constants
from cachecd.errors import ConfigInvalid
from cachecd.secrets import Secret
from cachecd.store.policies import POLICIES

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str | int, key: str = "size") -> int:
    """Bytes from '16MiB', '2G', '1.5TB' or a plain integer (binary units for i, decimal otherwise)."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise ConfigInvalid(f"{key}: cannot read {text!r} as a size (examples: 500GB, 16MiB, 0)")
        number, unit, binary = match.groups()
        base = 1024 if (binary or unit.lower() == "") else 1000
        value = int(float(number) * base ** _UNITS[unit.lower()])
    if value < 0:
        raise ConfigInvalid(f"{key}: a size cannot be negative ({text!r})")
    return value


def parse_rate(text: str | int, key: str = "rate") -> int:
    """Bytes a second from '4MiB', '4MiB/s' or a plain integer; 0 is allowed (off)."""
    if isinstance(text, str) and text.strip().lower().endswith("/s"):
        text = text.strip()[:-2]
    return parse_size(text, key)


@dataclass
class Settings:
    cache_dirs: list[Path] = field(default_factory=lambda: [constants.DEFAULT_CACHE_DIR])
    models_dir: Path = constants.DEFAULT_MODELS_DIR
    socket: Path = constants.DEFAULT_SOCKET
    budget: int = constants.DEFAULT_BUDGET
    endpoint: str = constants.HF_ENDPOINT
    offline: bool = constants.HF_HUB_OFFLINE
    manifests: list[Path] = field(default_factory=list)
    policy: str = "default"
    max_parallel: int = constants.MAX_PARALLEL_FETCHES
    map_size: int = constants.LMDB_MAP_SIZE
    log_level: str = constants.DEFAULT_LOG_LEVEL
    shutdown_timeout: float = constants.SHUTDOWN_TIMEOUT_S
    read_timeout: float = constants.READ_TIMEOUT_S
    total_timeout: float = constants.TOTAL_TIMEOUT_S
    scrub_rate: int = constants.DEFAULT_SCRUB_RATE  # bytes a second; 0: no background scrub
    share: str = ""  # HOST:PORT to serve verified experts to peers on; "": no sharing
    share_token_file: Path | None = None
    peers: list[str] = field(default_factory=list)  # base URLs of peers' --share, asked first
    peer_token_file: Path | None = None
    peer_deadline: float = constants.PEER_DEADLINE_S
    peer_min_rate: int = constants.PEER_MIN_RATE  # bytes/s: a request may take deadline + bytes/this
    # Fetch the experts of a model installed from another endpoint from this one (bytes are
    # verified against its manifest either way); off: such misses are refused (endpoint_mismatch).
    allow_other_endpoint: bool = False

    @property
    def data_socket(self) -> Path:
        return data_socket_path(self.socket)


def data_socket_path(control: Path) -> Path:
    """The fd-passing socket lives beside the control socket, in the same 0700 directory."""
    return control.with_name(control.name + ".data")


# key -> (parser, env var). Keys are the TOML keys and the argparse dests.
def _paths(value: Any, key: str) -> list[Path]:
    if isinstance(value, str):
        value = [v for v in value.split(os.pathsep) if v]
    if not isinstance(value, list) or not value:
        raise ConfigInvalid(f"{key}: expected one or more paths, got {value!r}")
    return [Path(v).expanduser() for v in value]


def _dirs(value: Any, key: str) -> list[Path]:
    paths = _paths(value, key)
    for path in paths:
        _not_a_file(path, key)
    return paths


def _dir(value: Any, key: str) -> Path:
    return _not_a_file(_path(value, key), key)


def _not_a_file(path: Path, key: str) -> Path:
    """A directory cachecd makes if missing; a file there is refused now, with its name, rather
    than failing later with EEXIST."""
    if path.exists() and not path.is_dir():
        raise ConfigInvalid(f"{key}: {path} is a file, not a directory; give a directory "
                            "(cachecd makes it if it does not exist)")
    return path


def _path(value: Any, key: str) -> Path:
    if not isinstance(value, (str, Path)) or not str(value):
        raise ConfigInvalid(f"{key}: expected a path, got {value!r}")
    return Path(value).expanduser()


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes", "on"):
        return True
    if str(value).lower() in ("0", "false", "no", "off", ""):
        return False
    raise ConfigInvalid(f"{key}: expected true/false, got {value!r}")


def _positive_int(value: Any, key: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigInvalid(f"{key}: expected a whole number, got {value!r}") from None
    if number < 1:
        raise ConfigInvalid(f"{key}: must be at least 1, got {number}")
    return number


def _seconds(value: Any, key: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigInvalid(f"{key}: expected a number of seconds, got {value!r}") from None
    if not number > 0:
        raise ConfigInvalid(f"{key}: must be more than 0 seconds, got {number}")
    return number


def _choice(*allowed: str):  # type: ignore[no-untyped-def]
    def parse(value: Any, key: str) -> str:
        if str(value) not in allowed:
            raise ConfigInvalid(f"{key}: {value!r} is not one of {', '.join(allowed)}")
        return str(value)

    return parse


def _positive_rate(value: Any, key: str) -> int:
    rate = parse_rate(value, key)
    if rate <= 0:
        raise ConfigInvalid(f"{key}: must be more than 0 bytes a second, got {value!r}")
    return rate


def _host_port(value: Any, key: str) -> str:
    host, sep, port = _text(value, key).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigInvalid(f"{key}: expected HOST:PORT (e.g. 192.168.2.1:7390), got {value!r}")
    return str(value)


def _urls(value: Any, key: str) -> list[str]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ConfigInvalid(f"{key}: expected a list of URLs, got {value!r}")
    out = []
    for item in items:
        url = _text(item, key).strip().rstrip("/")
        if not re.match(r"^https?://[^/\s]+$", url):
            raise ConfigInvalid(f"{key}: expected a peer's URL like http://HOST:PORT, got {item!r}")
        out.append(url)
    return out


def read_token_file(path: Path | None, key: str) -> Secret:
    """The bearer token in ``path``: refused when missing, empty, readable or writable by group
    or others (one who can write it can swap the token), owned by another user, or shorter
    than ``TOKEN_MIN_BITS`` of secret. A ``Secret``: redacted wherever it is printed."""
    what = (f"{key}: write a long random token to a file only you can read, e.g. `python3 -c "
            "'import secrets; print(secrets.token_hex(32))' > FILE && chmod 600 FILE`, the same "
            "token on every host that shares or peers")
    if path is None:
        raise ConfigInvalid(f"{key} is required with sharing or peers; {what}")
    try:
        st = path.stat()
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigInvalid(f"{key}: cannot read {path} ({exc.strerror}); {what}") from None
    if st.st_mode & 0o077:
        who = "every user" if st.st_mode & 0o007 else "its group"
        how = "readable" if st.st_mode & 0o044 else "writable"
        how = "readable and writable" if st.st_mode & 0o044 and st.st_mode & 0o022 else how
        raise ConfigInvalid(f"{key}: {path} is {how} by {who} (mode {st.st_mode & 0o777:o}); "
                            f"make it private: `chmod 600 {path}`")
    if st.st_uid != os.geteuid():
        # Its owner can change the token, or read it whatever its mode says.
        raise ConfigInvalid(f"{key}: {path} is owned by uid {st.st_uid}, not by the user the "
                            f"daemon runs as (uid {os.geteuid()}); {what}")
    if not token:
        raise ConfigInvalid(f"{key}: {path} is empty; {what}")
    if (bits := token_bits(token)) < TOKEN_MIN_BITS:
        raise ConfigInvalid(f"{key}: the token in {path} holds about {bits} bits of secret, "
                            f"fewer than {TOKEN_MIN_BITS}: anyone on the link could guess it; "
                            f"{what}")
    return Secret(token)


TOKEN_MIN_BITS = 128


def token_bits(token: str) -> int:
    """The most secret a token can hold: its length times the bits of its alphabet (hex 4,
    base64 6, other printable text 6.5). A random token reaches it; a chosen word falls short
    of it, which no count of characters can see."""
    if re.fullmatch(r"[0-9a-fA-F]+", token):
        per = 4.0
    elif re.fullmatch(r"[A-Za-z0-9+/=_-]+", token):
        per = 6.0
    else:
        per = math.log2(95)
    return int(len(token) * per)


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigInvalid(f"{key}: expected text, got {value!r}")
    return value


def _endpoint(value: Any, key: str) -> str:
    url = _text(value, key)
    # A bare host:port would fail later as a lost connection; file:// names a local folder source.
    if not re.match(r"^(https?://[^/\s]+|file:///?\S)", url):
        raise ConfigInvalid(
            f"{key}: expected a URL like http://HOST:PORT (or file:///DIR), got {value!r}")
    return url


_FIELDS = {
    "cache_dirs": _dirs,
    "models_dir": _dir,
    "socket": _path,
    "budget": lambda v, k: parse_size(v, k),
    "endpoint": _endpoint,
    "offline": _bool,
    "manifests": _paths,
    "policy": lambda v, k: _choice(*POLICIES)(v, k),
    "max_parallel": _positive_int,
    "map_size": lambda v, k: parse_size(v, k),
    "log_level": _choice("DEBUG", "INFO", "WARNING", "ERROR"),
    "shutdown_timeout": lambda v, k: float(v),
    "read_timeout": _seconds,
    "total_timeout": _seconds,
    "scrub_rate": lambda v, k: parse_rate(v, k),
    "share": lambda v, k: _host_port(v, k),
    "share_token_file": _path,
    "peers": lambda v, k: _urls(v, k),
    "peer_token_file": _path,
    "peer_deadline": _seconds,
    "peer_min_rate": lambda v, k: _positive_rate(v, k),
    "allow_other_endpoint": _bool,
}
# What `cachecd setup` records of its command line for later starts of the same daemon.
RECORDED_KEYS = ("endpoint", "cache_dirs", "models_dir", "budget", "share", "share_token_file",
                 "peers", "peer_token_file")


_FLAGS = {"cache_dirs": "--cache-dir", "manifests": "--manifest", "peers": "--peer"}  # repeatable flags' names


def _env_layer(environ: Mapping[str, str]) -> dict[str, Any]:
    layer = {}
    for key in _FIELDS:
        env_key = constants.ENV_PREFIX + key.upper()
        if env_key in environ:
            layer[key] = (environ[env_key], f"${env_key}")
    return layer


def _toml_layer(path: Path | None, explicit: bool = True, named: bool = False) -> dict[str, Any]:
    """The file's keys; ``named``: $CACHECD_CONFIG names it, so it must be there."""
    if path is None:
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        if named and path != constants.DEFAULT_CONFIG_FILE:  # a typo must not go unnoticed
            raise ConfigInvalid(f"{path}: no such config file (named by $CACHECD_CONFIG); create "
                                "it, or unset CACHECD_CONFIG to read "
                                f"{constants.DEFAULT_CONFIG_FILE} if it exists") from None
        return {}
    except IsADirectoryError:
        raise ConfigInvalid(f"{path}: the config file is a directory; name a TOML file") from None
    except PermissionError:
        if not explicit:  # the default path under someone else's HOME: as if absent
            return {}
        raise ConfigInvalid(f"{path}: the config file is not readable by uid {os.getuid()}") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigInvalid(f"{path}: cannot read the config file: {exc}") from exc
    unknown = set(data) - set(_FIELDS)
    if unknown:
        raise ConfigInvalid(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    return {k: (v, f"{path}:{k}") for k, v in data.items()}


def recorded_path(config_file: Path, socket: Path) -> Path:
    """Where setup records its settings for the daemon on ``socket``: beside the config file
    (so a service, which is given the config file's path, finds it too); ``setup.toml`` for
    the default socket, ``setup-<hash of the socket's path>.toml`` for any other."""
    socket = Path(socket).expanduser().absolute()
    if socket == constants.DEFAULT_SOCKET.absolute():
        return config_file.parent / "setup.toml"
    return config_file.parent / f"setup-{hashlib.sha256(str(socket).encode()).hexdigest()[:12]}.toml"


def active_config_file(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    return Path(environ.get("CACHECD_CONFIG", str(constants.DEFAULT_CONFIG_FILE)))


def _recorded_layer(config_file: Path, merged: Mapping[str, Any]) -> dict[str, Any]:
    """Setup's record for the socket the other layers name (``recorded_path``)."""
    socket = (_path(*merged["socket"]) if "socket" in merged else constants.DEFAULT_SOCKET)
    layer = _toml_layer(recorded_path(config_file, socket), explicit=False)
    extra = set(layer) - set(RECORDED_KEYS)
    if extra:
        raise ConfigInvalid(f"{recorded_path(config_file, socket)}: {', '.join(sorted(extra))} "
                            f"cannot be recorded there (only {', '.join(RECORDED_KEYS)}); "
                            "remove the line, or move it to the config file")
    return layer


def load_settings(
    argv_values: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> Settings:
    """Merge the layers; ``argv_values`` holds only what the user gave on the command line."""
    environ = os.environ if environ is None else environ
    explicit = config_file is not None or "CACHECD_CONFIG" in environ
    named = config_file is None and "CACHECD_CONFIG" in environ
    if config_file is None:
        config_file = active_config_file(environ)
    argv: dict[str, Any] = {}
    for key, value in (argv_values or {}).items():
        if value is not None and key in _FIELDS:
            argv[key] = (value, _FLAGS.get(key, f"--{key.replace('_', '-')}"))
    merged: dict[str, Any] = {}
    merged.update(_toml_layer(config_file, explicit, named))
    env = _env_layer(environ)
    merged.update(_recorded_layer(config_file, {**merged, **env, **argv}))
    merged.update(env)
    merged.update(argv)
    settings = Settings()
    for key, (value, origin) in merged.items():
        setattr(settings, key, _FIELDS[key](value, origin))
    if "models_dir" not in merged and "cache_dirs" in merged:  # as MODELS_DIR_HELP says
        settings.models_dir = _not_a_file(settings.cache_dirs[0].parent / "models", "models_dir")
    return settings


def settings_summary(settings: Settings) -> dict[str, Any]:
    """What a daemon started with ``settings`` does differently from another: the running
    daemon's status carries it, and ``service install --dry-run`` compares it with the unit's."""
    return {
        "endpoint": settings.endpoint,
        "cache_dirs": [str(Path(d).absolute()) for d in settings.cache_dirs],
        "models_dir": str(Path(settings.models_dir).absolute()),
        "budget": settings.budget,
        "share": settings.share,
        "peers": list(settings.peers),
        "policy": settings.policy,
        "max_parallel": settings.max_parallel,
        "offline": settings.offline,
        "scrub_rate": settings.scrub_rate,
        "allow_other_endpoint": settings.allow_other_endpoint,
    }


# What --models-dir is when not given (load_settings' rule), for every command that takes it.
MODELS_DIR_HELP = (
    "where resident files and manifest copies go (default: CACHECD_MODELS_DIR or the config's "
    "models_dir; else, when a cache dir is given (--cache-dir, CACHECD_CACHE_DIRS or the "
    "config's cache_dirs), models/ beside the first one (DIR/../models); else "
    f"{constants.DEFAULT_MODELS_DIR})")


def add_common_arguments(parser: Any) -> None:
    """The flags every command that talks to a daemon takes."""
    parser.add_argument("--socket", metavar="PATH",
                        help="the daemon's control socket (default: CACHECD_SOCKET or the "
                             f"config's, else {constants.DEFAULT_SOCKET})")
