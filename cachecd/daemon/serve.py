"""``cachecd serve``: the daemon in the foreground (what launchd and systemd run).

Start-up order matters: the cache lock is taken and recovery (temps, bad rows, strays, eviction
down to the budget) finishes before either socket is bound, so no client ever sees a cache that
is over budget or half-recovered. Under a ``Type=notify`` systemd unit, ``READY=1`` is sent only
once both sockets accept (``notify``). SIGTERM/SIGINT drain: stop accepting, let fetches in
flight finish within ``shutdown_timeout``, close LMDB, remove the sockets, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from cachecd import constants
from cachecd.config import MODELS_DIR_HELP, Settings, load_settings, parse_size
from cachecd.daemon.notify import notify
from cachecd.secrets import Secret

log = logging.getLogger(__name__)


def add_daemon_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", dest="cache_dirs", action="append", metavar="DIR",
                   help="a cache directory (repeat for one per SSD; default: "
                        f"{constants.DEFAULT_CACHE_DIR})")
    p.add_argument("--budget", help="disk budget for experts, e.g. 500GB or 16MiB; 0 = free space "
                   "(default: 0)")
    p.add_argument("--socket", help="control socket path, the data socket beside it (default: "
                   f"{constants.DEFAULT_SOCKET})")
    p.add_argument("--endpoint", help="Hub endpoint (default: $HF_ENDPOINT or huggingface.co)")
    p.add_argument("--manifest", dest="manifests", action="append", metavar="FILE",
                   help="register a model manifest at start (repeatable; default: only the "
                        "models registered before)")
    p.add_argument("--models-dir", help=MODELS_DIR_HELP)
    p.add_argument("--policy", help="eviction policy: default (wlfu), wlfu, lfuda or lru")
    p.add_argument("--max-parallel", type=int, help="upstream requests in flight at once "
                   f"(default: {constants.MAX_PARALLEL_FETCHES})")
    p.add_argument("--offline", action="store_const", const=True, default=None,
                   help="serve hits only; refuse misses (also HF_HUB_OFFLINE=1)")
    p.add_argument("--scrub-rate", metavar="RATE",
                   help="background scrub: re-hash every cached blob in turn at RATE bytes a "
                        "second, e.g. 4MiB (the default); 0 turns it off")
    p.add_argument("--share", metavar="HOST:PORT",
                   help="serve this daemon's verified experts to peers over HTTP on HOST:PORT "
                        "only (default: off; docs/sharing.md)")
    p.add_argument("--share-token-file", metavar="FILE",
                   help="with --share: the bearer token peers must send, in a file only you can read "
                        "(default: none; required with --share)")
    p.add_argument("--peer", dest="peers", action="append", metavar="URL",
                   help="ask this peer's --share (http://HOST:PORT) for experts before the Hub "
                        "(repeatable; asked in order; default: no peers)")
    p.add_argument("--peer-token-file", metavar="FILE",
                   help="with --peer: the token the peers' --share-token-file holds (default: none; "
                        "required with --peer)")
    p.add_argument("--peer-deadline", metavar="S",
                   help=f"seconds a peer may take to connect, to start answering, or with no "
                        f"byte coming (a stall), before the Hub is asked instead; a peer that "
                        f"keeps sending is waited for, one that misses it is skipped for "
                        f"{constants.PEER_DOWN_SKIP_S:g} s, doubled at each fault in a row up "
                        f"to {constants.PEER_DOWN_SKIP_MAX_S / 60:g} min, until it answers "
                        f"(default: {constants.PEER_DEADLINE_S:g})")
    p.add_argument("--peer-min-rate", metavar="RATE",
                   help="a peer's request may take --peer-deadline plus its bytes at RATE (e.g. "
                        "1MiB/s), no longer; a peer that sends slower is dropped for the Hub and "
                        f"not asked for {constants.PEER_SKIP_S / 60:g} minutes (default: "
                        f"{constants.PEER_MIN_RATE >> 20}MiB/s)")
    p.add_argument("--allow-other-endpoint", action="store_const", const=True, default=None,
                   help="fetch the experts of a model installed from another endpoint from this "
                        "daemon's --endpoint (verified against its manifest all the same); "
                        "without it such a model's misses are refused (endpoint_mismatch) and "
                        "only its cached experts are served (default: off)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    keys = ("cache_dirs", "budget", "socket", "endpoint", "manifests", "models_dir", "policy",
            "max_parallel", "offline", "scrub_rate", "share", "share_token_file", "peers",
            "peer_token_file", "peer_deadline", "peer_min_rate", "allow_other_endpoint")
    return load_settings({k: getattr(args, k, None) for k in keys})


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the daemon in the foreground")
    add_daemon_arguments(p)
    p.add_argument("--log-file", type=Path, metavar="FILE",
                   help="log to FILE, rotated (default: stderr, which launchd and journald "
                        "collect)")
    p.add_argument("--log-max-bytes", default=f"{constants.DAEMON_LOG_MAX_BYTES >> 20}MiB",
                   metavar="SIZE", help=f"with --log-file: start a new file past SIZE, keeping "
                   f"{constants.DAEMON_LOG_BACKUPS} old ones (FILE.1, ...)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if args.log_file:
        log_to_file(args.log_file, parse_size(args.log_max_bytes, "--log-max-bytes"))
    logging.getLogger().setLevel(logging.DEBUG if args.debug else settings.log_level)
    logging.getLogger("aiohttp.server").addFilter(_MalformedRequestLine())
    return asyncio.run(serve(settings))


def log_to_file(path: Path, max_bytes: int, backups: int = constants.DAEMON_LOG_BACKUPS) -> None:
    """The log goes to ``path`` instead of stderr, in the same format, rotated by size: at most
    ``backups + 1`` files of ``max_bytes`` on disk however long the daemon runs."""
    from logging.handlers import RotatingFileHandler

    from cachecd.secrets import install

    class PrivateLog(RotatingFileHandler):
        """Each file 0600 from its creation (a rotation's new one too): a log may name hosts,
        models and paths; only the daemon's user reads it."""

        def _open(self) -> Any:
            fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.fchmod(fd, 0o600)  # one an older cachecd left 0644
            return open(fd, "a", encoding=self.encoding, errors=self.errors)

    path.parent.mkdir(parents=True, exist_ok=True)
    handler = PrivateLog(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
    root = logging.getLogger()
    for old in root.handlers[:]:
        handler.setFormatter(old.formatter)  # cli's format
        root.removeHandler(old)
    root.addHandler(handler)
    install()  # the new handler scrubs tokens as the old one did


class _MalformedRequestLine(logging.Filter):
    """aiohttp logs a request it cannot parse at ERROR with a traceback. For the daemon that is
    a client's mistake, already answered 400: keep one WARNING line, no traceback, no raw bytes
    beyond a short excerpt (they could hold a header's token)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            first = str(exc.message).strip().splitlines()[0][:120] if exc.message else ""
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = "event=malformed_request status=%d err=%s", (exc.code, first)
            record.exc_info, record.exc_text = None, None
        return True


async def _start(settings: Settings) -> tuple[Any, list[Any]]:
    from aiohttp import web

    from cachecd.daemon.adopt import adopt_pre_provenance
    from cachecd.daemon.app import Daemon
    from cachecd.daemon.control_door import ControlDoor, ControlSite
    from cachecd.daemon.datapath import DataServer
    from cachecd.daemon.peer import bind_private_socket
    from cachecd.daemon.routes import build_app
    from cachecd.daemon.share import Sharing
    from cachecd.daemon.share_door import exposure, raise_fd_limit
    from cachecd.store.store import Store
    from cachecd.upstream.choose import open_upstream

    if settings.share and (said := exposure(settings.share)):
        log.warning("share exposed: %s", said)
    share_token, peer_token = tokens(settings)  # a bad token file stops us before any work
    # Every connection, blob and upstream socket is an fd: take what the hard limit allows
    # (systemd's soft default is 1,024, launchd's 256), before anything is opened.
    log.info("open files limit=%d", raise_fd_limit())
    notify("STATUS=recovering the cache: " + ", ".join(map(str, settings.cache_dirs)))
    store = await Store.open(settings.cache_dirs, budget=settings.budget, policy=settings.policy,
                             map_size=settings.map_size)
    notify("STATUS=registering models")
    # huggingface_hub may fetch a small registry synchronously the first time it builds headers:
    # keep that off the event loop. Token None: the one huggingface_hub finds, at each resolve.
    upstream = await asyncio.to_thread(open_upstream, settings, None, peer_token)
    daemon = Daemon(settings, store, upstream)
    await daemon.registry.load_registered()
    await adopt_pre_provenance(store, daemon.registry.all())  # once, after a schema-1 index
    # The sockets answer first: `status` works while the models given at start are checked
    # against their endpoint (a stalled endpoint holds those checks, not the daemon).
    control = bind_private_socket(settings.socket)
    data = bind_private_socket(settings.data_socket)
    handler_args: dict[str, Any] = {"access_log": None}
    door = ControlDoor(constants.MAX_CONTROL_CONNECTIONS, daemon.counters, handler_args)
    runner = web.AppRunner(build_app(daemon, constants.CLIENT_MAX_SIZE, door), handle_signals=False,
                           **handler_args)
    await runner.setup()
    await ControlSite(runner, control, door).start()
    data_server = DataServer(daemon, data)
    data_server.start()
    daemon.registry.starting = {str(p) for p in settings.manifests}
    for path in settings.manifests:
        await _register_or_refuse(daemon, Path(path))
        daemon.registry.starting.discard(str(path))
    for line in start_warnings(daemon):
        log.warning(line)
        print(f"cachecd: warning: {line}", file=sys.stderr, flush=True)
    daemon.scrub.start()
    servers: list[Any] = [runner, data_server]
    if share_token:
        daemon.sharing = Sharing(daemon, share_token)
        await daemon.sharing.start(settings.share)
        servers.append(daemon.sharing)
    # Both sockets accept connections now: a client ordered after the unit finds a daemon.
    notify("READY=1", f"STATUS=serving on {settings.socket}")
    return daemon, servers


def tokens(settings: Settings) -> tuple[Secret | None, Secret | None]:
    """The share and peer tokens the settings ask for (ConfigInvalid saying what to do)."""
    from cachecd.config import read_token_file

    share = read_token_file(settings.share_token_file, "share_token_file") if settings.share else None
    peer = read_token_file(settings.peer_token_file, "peer_token_file") if settings.peers else None
    return share, peer


def start_warnings(daemon: Any) -> list[str]:
    """What a user must hear at start about the registered models: one installed from another
    endpoint (its misses are refused, or fetched from here if allowed), a budget too small for
    one prefill step of one (``manifest.step_need``)."""
    from cachecd.manifest.step_need import step_need, too_small, top_k_in

    here, budget = daemon.settings.endpoint, daemon.settings.budget
    out = []
    for model in daemon.registry.all():
        if model.other_endpoint(here):
            then = ("its experts that are not cached are fetched from here "
                    "(--allow-other-endpoint)" if daemon.settings.allow_other_endpoint else
                    "its experts that are not cached are NOT fetched (endpoint_mismatch) until "
                    f"the daemon runs with --endpoint {model.endpoint} or --allow-other-endpoint, "
                    f"or setup is re-run with --endpoint {here}")
            out.append(f"event=endpoint_mismatch model={model.name} installed_from="
                       f"{model.endpoint} endpoint={here}: {then}")
        if budget:
            need = step_need(model.manifest, top_k_in(model.local_dir), served=model.served_rows())
            if need.nbytes > budget:
                out.append(f"event=budget_too_small model={model.name}: "
                           f"{too_small(budget, need, model.name)}")
    return out


async def _register_or_refuse(daemon: Any, path: Path) -> None:
    """A bad --manifest refuses that model only; the daemon still serves the others."""
    from cachecd.errors import CachecdError
    from cachecd.manifest.manifest import read_manifest_file

    try:
        model = await daemon.registry.register(await asyncio.to_thread(read_manifest_file, path),
                                               str(path), None, origin=str(path.resolve()),
                                               endpoint=daemon.settings.endpoint)
        daemon.registry.at_start.add(model.repo)
    except (CachecdError, OSError) as exc:
        reason = exc.message if isinstance(exc, CachecdError) else f"cannot read {path}: {exc}"
        daemon.registry.refused[str(path)] = reason
        log.error("model refused manifest=%s reason=%s", path, reason)
    except Exception as exc:  # anything else about one model refuses that model, never the daemon
        reason = (f"{path}: its registration failed ({type(exc).__name__}: {str(exc)[:200]}); "
                  f"`cachecd manifest verify {path}` says more")
        daemon.registry.refused[str(path)] = reason
        log.error("model refused manifest=%s reason=%s", path, reason)
        log.debug("model refused manifest=%s", path, exc_info=True)


async def serve(settings: Settings) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    daemon, (runner, data_server, *sharing) = await _start(settings)
    log.info("listening socket=%s data=%s cache_dirs=%s budget=%d endpoint=%s scrub_rate=%d",
             settings.socket, settings.data_socket, ",".join(map(str, settings.cache_dirs)),
             settings.budget, settings.endpoint, settings.scrub_rate)
    print(f"cachecd: serving on {settings.socket}", file=sys.stderr, flush=True)
    await stop.wait()
    log.info("draining inflight=%d timeout=%.1fs", daemon.misses.inflight, settings.shutdown_timeout)
    daemon.draining = True
    notify("STOPPING=1", f"STATUS=draining {daemon.misses.inflight} fetches in flight")
    await daemon.misses.drain(settings.shutdown_timeout)
    await runner.cleanup()
    for server in sharing:
        await server.close()
    await data_server.close()
    await daemon.upstream.close()
    await asyncio.to_thread(daemon.scrub.stop)
    await daemon.store.close()
    for path in (settings.socket, settings.data_socket):
        path.unlink(missing_ok=True)
    log.info("stopped")
    return 0
