"""``cachecd hub serve DIR``: a Hugging Face Hub compatible endpoint over a folder of repos.

DIR/{org}/{name}/... is the model repo ``org/name``, DIR/datasets/{org}/{name}/... the dataset
repo; unmodified ``huggingface_hub`` with ``HF_ENDPOINT`` pointing here can list, resolve and
download (``app`` has the HTTP side and its invariants, ``repo`` which
files count and how the commit is made).

Ways to run it: the CLI (prints ``serving DIR at http://HOST:PORT`` once listening, stops
cleanly on SIGTERM/SIGINT), :class:`HubServer` / :func:`start_hub` inside a running event
loop, :func:`serve_in_thread` for synchronous code, :func:`spawn_hub` as a child process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

from aiohttp import web

from cachecd import constants
from cachecd.lanhub.app import (
    DATASETS,
    DEFAULT_URL_TTL_S,
    HUB_KEY,
    AccessLog,
    build_app,
)
from cachecd.lanhub.limits import ResolveLimit
from cachecd.lanhub.mirror import sidecar_path
from cachecd.lanhub.repo import HashCache, repo_commit, snapshot
from cachecd.lanhub.xet_routes import DEFAULT_TOKEN_TTL_S, DEFAULT_XORB_URL_TTL_S, XetSide
from cachecd.lanhub.xet_store import XetStore
from cachecd.manifest.repo_ref import valid_part

__all__ = ["HashCache", "HubServer", "repo_commit", "serve_in_thread", "spawn_hub", "start_hub"]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- running it


class HubServer:
    """The hub on a TCP port inside the running event loop. ``await start()`` gives the base URL."""

    def __init__(
        self,
        root: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        url_ttl_s: float = DEFAULT_URL_TTL_S,
        hashes: HashCache | None = None,
        gated: frozenset[str] = frozenset(),
        limit: ResolveLimit | None = None,
        xet: bool = True,
        xet_scheme: str = "lz4",
        xet_token_ttl_s: float = DEFAULT_TOKEN_TTL_S,
        xet_url_ttl_s: float = DEFAULT_XORB_URL_TTL_S,
        xorb_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.root, self.host, self.port = Path(root), host, port
        side = None
        if xet:  # the xorbs live beside the sha256 sidecars, under the resolved root
            store = XetStore(self.root.resolve(), scheme=xet_scheme, xorb_bytes=xorb_bytes)
            side = XetSide(store, token_ttl_s=xet_token_ttl_s, url_ttl_s=xet_url_ttl_s)
        self.app = build_app(self.root, token=token, url_ttl_s=url_ttl_s, hashes=hashes,
                             gated=gated, limit=limit, xet=side)
        self.runner = web.AppRunner(
            self.app,
            access_log_class=AccessLog,
            access_log=log,
            shutdown_timeout=constants.SHUTDOWN_TIMEOUT_S,
        )
        self.base_url = ""

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        port = self.runner.addresses[0][1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.base_url = f"http://{host}:{port}"
        log.info("hub listening root=%s url=%s", self.root, self.base_url)
        return self.base_url

    async def close(self) -> None:
        await self.runner.cleanup()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_hub(
    root: Path, host: str = "127.0.0.1", port: int = 0, token: str | None = None
) -> tuple[web.AppRunner, str]:
    """Start the hub in the running loop; stop it with ``await runner.cleanup()``."""
    server = HubServer(root, host=host, port=port, token=token)
    return server.runner, await server.start()


@contextmanager
def serve_in_thread(
    root: Path,
    *,
    token: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    hashes: HashCache | None = None,
    **options: Any,
) -> Iterator[str]:
    """The hub on its own event loop thread, for synchronous callers; yields the base URL.
    ``options``: more of :class:`HubServer`'s settings (``xet=False``, ``xet_url_ttl_s``...)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="hub-server", daemon=True)
    thread.start()
    server = HubServer(root, host=host, port=port, token=token, hashes=hashes, **options)
    try:
        yield asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def spawn_hub(
    root: Path,
    *,
    token: str | None = None,
    verbose: bool = False,
    extra_args: Sequence[str] = (),
    timeout_s: float = 30.0,
) -> tuple[subprocess.Popen[str], str]:
    """``cachecd hub serve ROOT`` as a child process; returns it and its base URL once listening.

    The caller owns the process: ``proc.terminate(); proc.wait()`` (it exits 0 on SIGTERM).
    """
    argv = [
        sys.executable,
        "-m",
        "cachecd.cli",
        *(["-v"] if verbose else []),
        "hub",
        "serve",
        str(root),
        *(["--token", token] if token else []),
        *extra_args,
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    match = re.search(r" at (http://\S+)$", line.strip())
    if match is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"hub server did not start: {line!r}")
    return proc, match.group(1)


def _prehash(root: Path, hashes: HashCache) -> None:
    models = [p for p in root.glob("*/*") if p.parent.name != DATASETS]
    for repo_dir in sorted(p for p in [*models, *root.glob(f"{DATASETS}/*/*")] if p.is_dir()):
        if not (valid_part(repo_dir.parent.name) and valid_part(repo_dir.name)):
            continue  # DIR/.cache, say: no route reaches it
        repo_id = f"{repo_dir.parent.name}/{repo_dir.name}"
        key = repo_id if repo_dir.parent.parent == root else f"{DATASETS}/{repo_id}"
        snap = snapshot(repo_dir, repo_id, hashes, sidecar_path(root, key))
        log.info("prehashed repo=%s commit=%s files=%d", snap.repo_id, snap.commit, len(snap.files))


def _limit(args: argparse.Namespace) -> ResolveLimit | None:
    if args.resolve_limit is None and args.resolve_limit_signed is None:
        return None
    anonymous = args.resolve_limit or args.resolve_limit_signed
    return ResolveLimit(anonymous, args.resolve_limit_signed or anonymous, args.limit_window)


async def serve_until_signal(args: argparse.Namespace) -> int:
    server = HubServer(
        args.dir, host=args.host, port=args.port, token=args.token,
        url_ttl_s=DEFAULT_URL_TTL_S if args.url_ttl is None else args.url_ttl,
        gated=frozenset(args.gated or ()), limit=_limit(args),
        xet=not args.no_xet, xet_scheme=args.xet_scheme,
        xet_token_ttl_s=args.xet_token_ttl, xet_url_ttl_s=args.xet_url_ttl,
        xorb_bytes=args.xorb_bytes,
    )
    side = server.app[HUB_KEY].xet
    for spec in args.xet_fault or ():
        assert side is not None  # cli refuses --xet-fault with --no-xet
        side.faults.set(spec)
    base_url = await server.start()
    if args.prehash:
        hashes = server.app[HUB_KEY].hashes
        root = server.app[HUB_KEY].root  # resolved, as the handlers name sidecars
        threading.Thread(target=_prehash, args=(root, hashes), daemon=True).start()
    print(f"serving {args.dir} at {base_url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("hub stopping")
    await server.close()
    return 0
