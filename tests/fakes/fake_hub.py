"""FakeHub: an HF-compatible endpoint on 127.0.0.1:0 with per-test fault knobs (RELIABILITY.md).

Serves ``/{org}/{name}/resolve/{rev}/{file}`` (HEAD and GET) from a folder: a 302 to its own signed
``/cdn/...`` URL with X-Repo-Commit, X-Linked-Etag and X-Linked-Size. ``/cdn`` honours Range and
applies the knobs in ``hub.faults``. Every request is recorded (kind, path, Range, headers,
time.monotonic() at arrival, status) and the peak number of CDN GETs in flight is kept.

Use in-process (``async with FakeHub(folder) as hub``), from synchronous tests through
``FakeHubThread``, or as a subprocess: ``python -m tests.fakes.fake_hub FOLDER`` prints its URL.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from aiohttp import web

from tests.fakes.expert_shards import (  # noqa: F401 - re-exported for tests
    DEFAULT_REPO,
    DEFAULT_REVISION,
    FakeManifest,
    expert_bytes_of,
    write_expert_shards,
)

CHUNK = 64 * 1024
# web.RequestKey came in aiohttp 3.14; older releases (the lowest cachecd allows, which
# tests/install checks) key a request's state by string.
ARRIVAL: Any = (web.RequestKey("t_arrival", float) if hasattr(web, "RequestKey")
                else "t_arrival")


@dataclass
class Faults:
    """Knobs for /cdn GETs. Body faults apply to ``times`` requests (None: every request)."""

    flip_byte: bool = False
    ignore_range: bool = False
    wrong_content_range: bool = False
    pad_body: int = 0  # append this many bytes (Content-Length grows, Content-Range does not)
    short_body: int = 0  # drop this many bytes from the end (a clean, consistent short answer)
    serve_from: Path | None = None  # serve the same file names from this folder (another revision)
    truncate_after: int | None = None
    reset_after: int | None = None
    stall_after: int | None = None
    times: int | None = None
    status_script: list[int] = field(default_factory=list)  # popped per /cdn GET; 0 = normal
    retry_after: str | None = None  # sent with scripted 429/503
    ratelimit: str | None = None  # RateLimit header sent with scripted 429
    delay: float = 0.0  # before every /cdn GET answers
    resolve_status_script: list[int] = field(default_factory=list)  # popped per /resolve
    require_token: str | None = None  # /resolve answers 401 unless "Bearer <token>"
    direct: bool = False  # /resolve serves the bytes itself (a mirror), no redirect to /cdn


@dataclass(frozen=True)
class Record:
    kind: str  # resolve_head | resolve_get | cdn_get | cdn_head
    path: str
    range: str | None
    headers: dict[str, str]
    t: float
    status: int = 0


class FakeHub:
    def __init__(
        self,
        folder: str | Path,
        repo: str = DEFAULT_REPO,
        revision: str = DEFAULT_REVISION,
        *,
        url_ttl: float = 3600.0,
    ) -> None:
        self.folder = Path(folder)
        self.repo, self.revision = repo, revision
        self.url_ttl = url_ttl
        self.faults = Faults()
        self.records: list[Record] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.cuts: Counter[str] = Counter()  # bodies cut short: truncate, reset, stall
        self.url = ""
        self.public_url = ""  # what Locations point at when set (a FaultProxy in front of us)
        self._secret = secrets.token_bytes(16)
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._sha: dict[str, str] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, port: int = 0) -> str:
        app = web.Application(middlewares=[_stamp_arrival])
        app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{file:.+}", self._resolve)
        app.router.add_route("*", "/cdn/{org}/{name}/{rev}/{file:.+}", self._cdn)
        self.add_routes(app.router)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.url

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """More routes, for a subclass (``fake_xet``'s content store)."""

    async def close(self) -> None:
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- what tests read ---------------------------------------------------------------------
    def count(self, kind: str | None = None) -> int:
        return sum(1 for r in self.records if kind is None or r.kind == kind)

    def times(self, kind: str | None = None) -> list[float]:
        return [r.t for r in self.records if kind is None or r.kind == kind]

    def clear_records(self) -> None:
        self.records.clear()
        self.peak_in_flight = 0
        self.cuts.clear()

    def invalidate_urls(self) -> None:
        """Every signed URL handed out so far now answers 403 (a rotated CDN key)."""
        self._secret = secrets.token_bytes(16)

    def sha256(self, file: str) -> str:
        if file not in self._sha:
            self._sha[file] = hashlib.sha256((self.folder / file).read_bytes()).hexdigest()
        return self._sha[file]

    # -- handlers ----------------------------------------------------------------------------
    def _record(self, request: web.Request, kind: str, status: int) -> None:
        # t is when the request arrived (set by the middleware), not when it was answered.
        self.records.append(
            Record(
                kind,
                request.path,
                request.headers.get("Range"),
                dict(request.headers),
                request.get(ARRIVAL, time.monotonic()),
                status,
            )
        )

    def _file(self, request: web.Request) -> Path | None:
        m = request.match_info
        file = m["file"]
        if f"{m['org']}/{m['name']}" != self.repo or ".." in file.split("/"):
            return None
        path = self.folder / file
        return path if path.is_file() else None

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        kind = "resolve_head" if request.method == "HEAD" else "resolve_get"
        f = self.faults
        status = f.resolve_status_script.pop(0) if f.resolve_status_script else 0
        if (
            not status
            and f.require_token
            and request.headers.get("Authorization") != (f"Bearer {f.require_token}")
        ):
            status = 401
        path = self._file(request)
        if not status and (
            path is None or request.match_info["rev"] not in (self.revision, "main")
        ):
            status = 404
        if status or not f.direct:
            self._record(request, kind, status or 302)
        if status:
            return _error(status, f.retry_after if status in (429, 503) else None, f.ratelimit)
        assert path is not None
        if f.direct:
            return await self._send(request, kind, path, False)
        file = request.match_info["file"]
        expires = int(time.time() + self.url_ttl)
        cdn_path = f"/cdn/{self.repo}/{self.revision}/{file}"
        location = f"{self.public_url or self.url}{cdn_path}?expires={expires}&sig={self._sign(cdn_path, expires)}"
        headers = {
            "Location": location,
            "X-Repo-Commit": self.revision,
            "X-Linked-Etag": f'"{self.sha256(file)}"',
            "X-Linked-Size": str(path.stat().st_size),
            "ETag": f'"{self.sha256(file)}"',
            "X-Request-Id": f"Root=fake-{secrets.token_hex(4)}",
        }
        return web.Response(status=302, headers=headers)

    def _sign(self, path: str, expires: int) -> str:
        return hmac.new(self._secret, f"{path}:{expires}".encode(), "sha256").hexdigest()[:32]

    async def _cdn(self, request: web.Request) -> web.StreamResponse:
        kind = "cdn_head" if request.method == "HEAD" else "cdn_get"
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self._cdn_answer(request, kind)
        finally:
            self.in_flight -= 1

    async def _cdn_answer(self, request: web.Request, kind: str) -> web.StreamResponse:
        f = self.faults
        expires = request.query.get("expires", "0")
        ok = (
            expires.isdigit()
            and int(expires) > time.time()
            and hmac.compare_digest(
                request.query.get("sig", ""), self._sign(request.path, int(expires))
            )
        )
        path = self._file(request)
        scripted = f.status_script.pop(0) if kind == "cdn_get" and f.status_script else 0
        status = 403 if not ok else 404 if path is None else scripted
        if f.delay:
            await asyncio.sleep(f.delay)
        if status:
            self._record(request, kind, status)
            return _error(status, f.retry_after if status in (429, 503) else None, f.ratelimit)
        assert path is not None
        faulty = kind == "cdn_get" and (f.times is None or f.times > 0)
        if faulty and f.times is not None:
            f.times -= 1
        if faulty and f.serve_from is not None:
            path = f.serve_from / request.match_info["file"]
        return await self._send(request, kind, path, faulty)

    async def _send(
        self, request: web.Request, kind: str, path: Path, faulty: bool
    ) -> web.StreamResponse:
        f = self.faults
        size = path.stat().st_size
        rng = _parse_range(request.headers.get("Range"), size)
        if rng is None or (faulty and f.ignore_range):
            start, end, status = 0, size, 200
        else:
            start, end, status = rng[0], rng[1], 206
        if start >= end and status == 206:
            self._record(request, kind, 416)
            return _error(416, None, None)
        body = bytearray(_read(path, start, end) if kind.endswith("_get") else b"")
        resp = web.StreamResponse(status=status)
        if status == 206:
            shift = 1 if faulty and f.wrong_content_range else 0
            resp.headers["Content-Range"] = f"bytes {start + shift}-{end - 1 + shift}/{size}"
        if faulty and f.flip_byte and body:
            body[len(body) // 2] ^= 0x01
        if faulty and f.pad_body:
            body += b"\0" * f.pad_body
        if faulty and f.short_body:
            del body[max(0, len(body) - f.short_body) :]
        resp.headers["Accept-Ranges"] = "bytes"
        resp.content_length = len(body) if kind.endswith("_get") else end - start
        self._record(request, kind, status)
        await resp.prepare(request)
        if kind.endswith("_head"):
            return resp
        cut = _cut(f) if faulty else None
        await self._write(request, resp, memoryview(body)[: cut[1]] if cut else memoryview(body))
        if cut is not None:
            self.cuts[cut[0]] += 1
            await self._fault(request, cut[0])
            return resp
        await resp.write_eof()
        return resp

    async def _write(
        self, request: web.Request, resp: web.StreamResponse, body: memoryview
    ) -> None:
        try:
            for pos in range(0, len(body), CHUNK):
                await resp.write(body[pos : pos + CHUNK])
        except ConnectionResetError:
            return  # the client hung up (it closes a 200 it did not ask for unread): as a CDN

    async def _fault(self, request: web.Request, what: str) -> None:
        transport = request.transport
        if what == "stall":
            # Hold the connection open, sending nothing, until the client gives up or we close.
            while (
                not self._closing.is_set() and transport is not None and not transport.is_closing()
            ):
                await asyncio.sleep(0.05)
            return
        if transport is None:
            return
        if what == "reset":
            transport.abort()
        else:
            transport.close()


@web.middleware
async def _stamp_arrival(request: web.Request, handler: Any) -> web.StreamResponse:
    request[ARRIVAL] = time.monotonic()
    return await handler(request)


def _read(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(start)
        return fh.read(end - start)


def _cut(f: Faults) -> tuple[str, int] | None:
    if f.truncate_after is not None:
        return "truncate", f.truncate_after
    if f.reset_after is not None:
        return "reset", f.reset_after
    if f.stall_after is not None:
        return "stall", f.stall_after
    return None


def _parse_range(value: str | None, size: int) -> tuple[int, int] | None:
    if not value or not value.startswith("bytes=") or "," in value:
        return None
    first, _, last = value[6:].partition("-")
    if not first.isdigit():
        return None
    start = int(first)
    end = min(size, int(last) + 1) if last.isdigit() else size
    return start, end


def _error(status: int, retry_after: str | None, ratelimit: str | None) -> web.Response:
    headers = {
        "X-Request-Id": f"Root=fake-{secrets.token_hex(4)}",
        "X-Error-Message": f"fake hub says {status}",
    }
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    if ratelimit is not None and status == 429:
        headers["RateLimit"] = ratelimit
    return web.Response(status=status, text=f"fake hub says {status}", headers=headers)


class FakeHubThread:
    """A FakeHub on its own event loop in a daemon thread, for synchronous tests."""

    def __init__(self, folder: str | Path, **kw: Any) -> None:
        self._kw, self._folder = kw, folder
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.hub: FakeHub

    def start(self) -> str:
        self._thread.start()
        self.hub = self._call(self._make())
        return self.hub.url

    async def _make(self) -> FakeHub:
        hub = FakeHub(self._folder, **self._kw)
        await hub.start()
        return hub

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def stop(self) -> None:
        self._call(self.hub.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> FakeHub:
        self.start()
        return self.hub

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="serve a folder as a fake HF endpoint")
    parser.add_argument("folder")
    parser.add_argument("--repo", default=DEFAULT_REPO)
    parser.add_argument("--revision", default=DEFAULT_REVISION)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()

    async def serve() -> None:
        hub = FakeHub(args.folder, args.repo, args.revision)
        await hub.start(args.port)
        print(hub.url, flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await hub.close()

    asyncio.run(serve())


if __name__ == "__main__":
    main()


_FETCH_OPTS = ("coalesce_max_bytes", "coalesce_max_experts", "coalesce_max_gap",
               "coalesce_target_bytes", "checksum_refetches")


def hub_upstream(endpoint: str, token: str | bool | None = None, **opts: Any) -> Any:
    """``fetch.Upstream`` over a ``HubClient`` of ``endpoint``: ``opts`` are either's options."""
    from cachecd.upstream.fetch import Upstream
    from cachecd.upstream.hub_client import HubClient

    fetch = {k: opts.pop(k) for k in _FETCH_OPTS if k in opts}
    return Upstream(HubClient(endpoint, token, **opts), **fetch)
