"""Defaults and the environment, read once. Only this module and ``config`` read ``os.environ``.

Hugging Face's own variables (HF_HOME, HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE) are read through
``huggingface_hub.constants`` so cachecd agrees with every other HF tool on the machine.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

from huggingface_hub import constants as hf_constants

APP = "cachecd"
VERSION = "0.1.0"

# Index schema; bump with a migration in index.py.
INDEX_SCHEMA_VERSION = 2  # 2: the sources each blob was verified as (store/sources.py)
MANIFEST_FORMAT_VERSION = 1

# Model types the engine streams: their MoE layers expose ``mlp.switch_mlp`` as a SwitchGLU (the
# hook point). kimi_k2 (K2-Thinking's config) is mlx-lm's deepseek_v3 through its remapping.
SUPPORTED_MODEL_TYPES = ("kimi_k3", "kimi_k2", "deepseek_v3")

# K3 facts (DESIGN.md); used by benches and the synthetic K3-sized manifest.
K3_MOE_LAYERS = 92
K3_EXPERTS_PER_LAYER = 896
K3_EXPERT_BYTES = 17_547_264
K3_EXPERTS_PER_TOKEN = 16


def _user_cache_root() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / APP
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / APP


def _user_runtime_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and sys.platform != "darwin":
        return Path(runtime) / APP
    return _user_cache_root() / "run"


def _user_log_dir() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Logs" / APP
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / APP


ENV_PREFIX = "CACHECD_"

# Defaults (lowest precedence; config.py layers TOML, env and argv on top).
DEFAULT_CACHE_ROOT = _user_cache_root()
DEFAULT_CACHE_DIR = DEFAULT_CACHE_ROOT / "experts"
DEFAULT_MODELS_DIR = DEFAULT_CACHE_ROOT / "models"
DEFAULT_SOCKET = _user_runtime_dir() / "cachecd.sock"
DEFAULT_CONFIG_FILE = Path(
    os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
) / APP / "config.toml"
DEFAULT_BUDGET = 0  # 0: no budget beyond the free space of the cache dirs
DEFAULT_LOG_LEVEL = "INFO"
# Where a daemon that `setup` starts logs (a daemon under launchd or systemd logs to stderr, which
# they collect). Rotated by the daemon itself: at most (DAEMON_LOG_BACKUPS + 1) files of
# DAEMON_LOG_MAX_BYTES, 40 MiB, however long it runs.
LOG_DIR = Path(os.environ.get("CACHECD_LOG_DIR") or _user_log_dir())
DAEMON_LOG_MAX_BYTES = 10 * 1024 * 1024
DAEMON_LOG_BACKUPS = 3

# Upstream behaviour.
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0
TOTAL_TIMEOUT_S = 600.0
MAX_RETRIES = 5
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
MAX_PARALLEL_FETCHES = 8
# Peers (--peer): a peer must connect, start answering and keep sending (no stall this long)
# well within the Hub's time, or it is not worth asking; a slow, steady transfer is waited for.
PEER_DEADLINE_S = 2.0
PEER_SKIP_S = 300.0  # a peer that served wrong bytes or trickled is not asked again for this long
# A peer that could not be reached or did not answer (refused, no route, stalled, an HTTP error)
# is not asked for this long, doubled at each such fault in a row up to the most, until it
# answers: a powered-off host would otherwise cost each batch of misses its connect deadline.
PEER_DOWN_SKIP_S = 5.0
PEER_DOWN_SKIP_MAX_S = 300.0
# A peer's request may take the deadline plus its bytes at this rate, no longer: one that sends
# slower (a trickle just inside the stall deadline) is worth less than the Hub, and is skipped.
PEER_MIN_RATE = 1 << 20
# Sharing (--share): what one daemon gives its peers at once; past either bound it answers 503.
SHARE_MAX_REQUESTS = 16
SHARE_MAX_BYTES_IN_FLIGHT = 1 << 30
SHARE_MAX_EXPERTS_PER_REQUEST = 64
# The share's door (cachecd.daemon.share_door): connections held, an eighth of the soft fd limit
# within these bounds; a request head due this long after connecting, a body after its head; a
# kept-alive connection closed this long after its last answer (longer than the asking side's
# own keep-alive, aiohttp's 15 s, so it never reuses one the share is closing).
SHARE_MIN_CONNECTIONS = 8
SHARE_MAX_CONNECTIONS = 128
SHARE_HEADER_DEADLINE_S = 5.0
SHARE_BODY_DEADLINE_S = 5.0
SHARE_IDLE_DEADLINE_S = 30.0
COALESCE_MAX_BYTES = 256 * 1024 * 1024
COALESCE_MAX_EXPERTS = 16
# A request this long already amortizes its round trip: another expert gets its own request,
# so experts finish (and get stored) one by one instead of in pairs at the end.
COALESCE_TARGET_BYTES = 4 * 1024 * 1024
CHECKSUM_REFETCHES = 2
SIGNED_URL_TTL_S = 3600.0
# `cachecd manifest build --jobs`: shards streamed and hashed at once. Each is one connection
# and about a core of hashing; the /resolve count does not grow with it (one HEAD per file).
MANIFEST_BUILD_JOBS = 4

# Daemon behaviour.
SHUTDOWN_TIMEOUT_S = 10.0
# How long the engine (`cachecd run`, `cachecd openai`) waits for a daemon that stopped
# answering mid-read to come back (a restart, `service install`) before the read fails with
# `daemon_unavailable`; CACHECD_DAEMON_WAIT_S sets it (seconds).
DAEMON_RETURN_S = float(os.environ.get("CACHECD_DAEMON_WAIT_S") or 60.0)
DAEMON_RETURN_POLL_S = 0.2
CLIENT_MAX_SIZE = 16 * 1024 * 1024
MAX_BATCH_EXPERTS = 4096
MAX_CONNECTIONS = 256  # data socket
MAX_CONTROL_CONNECTIONS = 128  # control socket (cachecd.daemon.control_door)
# Open blob fds the daemon keeps for hits (a hit then costs an fstat and a dup, not an open).
# Unused ones are closed after BLOB_FDS_IDLE_S, stale ones (evicted, quarantined) sooner.
BLOB_FDS = 256
BLOB_FDS_IDLE_S = float(os.environ.get("CACHECD_BLOB_FDS_IDLE_S") or 1.0)  # env: tests only
# A blob is hashed again when it is opened and its last hash is older than this: rot that sets
# in while the daemon runs is caught within a day of it (at the blob's next open).
REVERIFY_AFTER_S = float(os.environ.get("CACHECD_REVERIFY_AFTER_S") or 86400.0)  # env: tests only
# Proven Xet chunks kept in memory (upstream.xet_cache); 0 keeps none. env: tests only (the fault
# suite's tampers must reach chunks no earlier window proved).
XET_KEEP_BYTES = int(os.environ.get("CACHECD_XET_KEEP_BYTES") or 64 << 20)
BLOB_FDS_SWEEP_S = 0.25
# The background scrub (store.scrub) re-hashes every cached blob in turn, continuously, at this
# many bytes a second (0: off). 4 MiB/s scrubs a full K3 cache (1.446 TB) in 4 days and a 500 GB
# one in 1.4, within Ceph's weekly deep scrub; it costs 0.04% of a core here (xxh3 over pread
# from the page cache, 0.11 CPU-s per GiB) and well under 1% of a laptop SSD's bandwidth.
DEFAULT_SCRUB_RATE = 4 * 1024 * 1024
# A blob costs the scrub at least a page of its rate (an open and a read are not free), and no
# more: a cache of small blobs is scrubbed at the rate asked, in the window promised.
SCRUB_MIN_BLOB_COST = 4096
# While demand fetches are in flight the scrub puts its next read off, by up to this many seconds
# of its rate, and catches up afterwards: demand comes first, and a pass still ends within
# (cache bytes / rate) plus this, however busy the daemon is.
SCRUB_DEFER_S = 2.0
# A pass starts at most this often unless a blob was added since the last one began: a cache a
# pass covers in less (a small one: at 4 MiB/s, 30 passes a second) is re-hashed hourly, and an
# idle daemon's scrub sleeps in between instead of spinning (issue 36 saw 7-8% of a core). A
# blob is also hashed at its first open a day after its last hash (REVERIFY_AFTER_S).
SCRUB_REST_S = float(os.environ.get("CACHECD_SCRUB_REST_S") or 3600.0)  # env: tests only
# At most one ``scrub_pass_done`` log line this often; it says how many passes it covers.
SCRUB_LOG_EVERY_S = 60.0
# Files quarantine/ keeps per cache dir, for a look at what rotted; older ones are deleted. Their
# bytes count against the budget while kept, so a failing disk cannot grow the cache past it.
QUARANTINE_KEEP = 4
# Reports (status, coverage, ...) wait for the commits of experts already answered; one whose
# fetch group is still downloading is waited for this long at most.
SETTLE_DOWNLOAD_WAIT_S = 2.0
LMDB_MAP_SIZE = 64 * 1024 * 1024
LMDB_MAP_CEILING = 64 * 1024 * 1024 * 1024

# Hugging Face environment, as huggingface_hub reads it.
HF_ENDPOINT: str = hf_constants.ENDPOINT
HF_HUB_OFFLINE: bool = bool(hf_constants.HF_HUB_OFFLINE)
HF_HOME: str = hf_constants.HF_HOME
# Proxies as curl and huggingface_hub read them: http_proxy, https_proxy, all_proxy, no_proxy
# (either case, lowercase first) -> {"http": url, "https": url, "all": url, "no": hosts}.
PROXIES: dict[str, str] = urllib.request.getproxies_environment()

# The engine's kernel model (cachecd_engine.pool.dispatch): MLX's own TF32 switch (unset: on), and
# the explicit flag that runs an MLX whose Metal dispatch is not modelled, with a warning.
MLX_ENABLE_TF32: str | None = os.environ.get("MLX_ENABLE_TF32")
ALLOW_UNMODELLED_MLX: bool = os.environ.get("CACHECD_ALLOW_UNMODELLED_MLX", "") not in ("", "0")

# systemd's readiness socket for a Type=notify unit (daemon.notify); unset outside systemd.
NOTIFY_SOCKET: str | None = os.environ.get("NOTIFY_SOCKET") or None

# Engine: record the routing trace to this file (``cachecd_engine.trace``); `run --trace` wins.
TRACE_PATH: str | None = os.environ.get("CACHECD_TRACE") or None

# Managed service (service/): where unit files go and what of the installing shell the service
# sees. HF_TOKEN is deliberately absent: a token never goes into a unit file; the service reads
# huggingface_hub's token file instead.
# CACHECD_SERVICE_INSTANCE names a second, separate service (tests use one so that a real install
# never touches the user's own); service.manager validates it.
SERVICE_INSTANCE = os.environ.get("CACHECD_SERVICE_INSTANCE", "")
SERVICE_LABEL = "io.cachecd.daemon" + (f".{SERVICE_INSTANCE}" if SERVICE_INSTANCE else "")
SYSTEMD_UNIT = APP + (f"-{SERVICE_INSTANCE}" if SERVICE_INSTANCE else "") + ".service"
SYSTEMD_USER_DIR = Path(
    os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
) / "systemd" / "user"
LAUNCH_AGENTS_DIR = Path.home() / "Library" / "LaunchAgents"
LAUNCHD_LOG_DIR = Path.home() / "Library" / "Logs" / APP
# The proxy variables go in too (a proxied network needs them in the service as in the shell),
# except one whose URL carries credentials: service.render leaves it out and says so.
SERVICE_PROXY_KEYS = tuple(
    k for name in ("https_proxy", "http_proxy", "all_proxy", "no_proxy") for k in (name.upper(), name)
)
_SERVICE_ENV_KEYS = (
    "HF_HOME", "HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_TOKEN_PATH", "HF_HUB_DISABLE_TELEMETRY",
    *SERVICE_PROXY_KEYS,
)
_SERVICE_ENV_SKIP = ("CACHECD_CRASH_AT", "CACHECD_PAUSE_AT", "CACHECD_CONFIG", "CACHECD_SERVICE_INSTANCE")
SERVICE_ENV: dict[str, str] = {
    k: v for k, v in sorted(os.environ.items())
    if k in _SERVICE_ENV_KEYS or (k.startswith(ENV_PREFIX) and k not in _SERVICE_ENV_SKIP)
}
# The config file the CLI reads now (as config.load_settings finds it); pinned into the service.
ACTIVE_CONFIG_FILE = Path(os.environ.get("CACHECD_CONFIG") or str(DEFAULT_CONFIG_FILE))
HF_TOKEN_IN_ENV: bool = bool(os.environ.get("HF_TOKEN"))
HF_TOKEN_PATH: str = hf_constants.HF_TOKEN_PATH

# Test and fault-injection knobs (see RELIABILITY.md). Never set in production.
CRASH_AT: str | None = os.environ.get("CACHECD_CRASH_AT") or None
# "POINT:SECONDS": sleep at that crash point instead (orders events in tests, no kill).
PAUSE_AT: str | None = os.environ.get("CACHECD_PAUSE_AT") or None
