"""``cachecd serve --share HOST:PORT``: this daemon's verified experts, read-only, to named peers.

The protocol (docs/sharing.md has it whole), version 2: every request carries ``Authorization:
Bearer TOKEN``; ``GET /v2/blob/DIGEST/SOURCE`` answers one blob, ``POST /v2/blobs`` with a JSON
list of ``{"digest": D, "source": S}`` answers the blobs it has concatenated in the asked order,
``X-Cachecd-Sizes`` listing each one's size (0: not here, no bytes in the body for it); ``GET
/metrics`` the daemon's prometheus registry. ``/v1/`` (by digest alone) answers 410.

Invariants:
- A request without the right token is answered 401 before anything else is looked at; the
  token is compared in constant time (``hmac.compare_digest``).
- A blob is named only by its digest, 32 lowercase hex characters, looked up in the store's
  index: nothing from the request becomes a path. It is served only for a source key (which
  shard bytes: ``manifest.provenance``) it was verified as here (``store.sources``): a peer whose
  manifest gives an expert another expert's digest gets nothing for it. A blob this process has not hashed is hashed
  before it is served (as a hit's first open does); rot is quarantined and answered as absent.
- At most ``max_requests`` requests and ``max_bytes`` of blobs are served at once; past either
  the answer is 503 with Retry-After, never a queue that grows. A request counts against them
  only once its token passed and its body is in (``share_door``: connections, their deadlines).
- ``/metrics`` shows a token holder only the share's and the peers' series (docs/sharing.md), no
  cache path and no model.
- Bodies go from the blob's fd to the socket with ``loop.sendfile`` (zero-copy where the
  platform has it), never loaded whole into Python.
The peer only trusts bytes it verified against its own manifest, so this side needs no
manifest: it serves what its store holds under the asked name.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import re
from collections import Counter
from typing import Any

from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler

from cachecd import constants
from cachecd.daemon.share_door import ShareDoor, ShareSite, connection_limit
from cachecd.errors import ExpertNotFound, ManifestInvalid
from cachecd.manifest.bounds import loads as bounded_loads
from cachecd.secrets import Secret, reveal

log = logging.getLogger(__name__)

DIGEST = re.compile(r"^[0-9a-f]{32}$")
SOURCE = DIGEST  # a source key is an xxh3-128 too
GONE = ("this share answers /v2/ only (blobs by digest and source, docs/sharing.md): "
        "upgrade cachecd on the asking machine")
SIZES_HEADER = "X-Cachecd-Sizes"
CHUNK = 1 << 20


class Sharing:
    """The HTTP server peers ask; ``counters`` feed ``status()['share']`` and ``/metrics``."""

    def __init__(self, daemon: Any, token: Secret | str, *,
                 max_requests: int = constants.SHARE_MAX_REQUESTS,
                 max_bytes: int = constants.SHARE_MAX_BYTES_IN_FLIGHT,
                 max_experts: int = constants.SHARE_MAX_EXPERTS_PER_REQUEST) -> None:
        self.daemon = daemon
        self._token = f"Bearer {reveal(token)}".encode()
        self.max_requests, self.max_bytes, self.max_experts = max_requests, max_bytes, max_experts
        self.requests = 0
        self.bytes_in_flight = 0
        self.counters: Counter[str] = Counter()
        self._runner: web.AppRunner | None = None
        self.door = ShareDoor(self.counters, *connection_limit())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.door.middleware, self._guard],
                              client_max_size=1 << 20)
        # Expect: 100-continue is answered by the route before any middleware: the token first.
        app.router.add_get("/v2/blob/{digest}/{source}", self._one, expect_handler=self._expect)
        app.router.add_post("/v2/blobs", self._many, expect_handler=self._expect)
        app.router.add_route("*", "/v1/{tail:.*}", self._gone)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, host_port: str) -> None:
        host, _, port = host_port.rpartition(":")
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        await ShareSite(self._runner, host.strip("[]"), int(port), self.door).start()
        log.info("sharing experts listen=%s connection_limit=%d per_address=%d", host_port,
                 self.door.limit, self.door.per_address)

    async def close(self) -> None:
        self.door.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def status(self) -> dict[str, int]:
        return {**self.counters, **self.door.status(), "requests_in_flight": self.requests,
                "bytes_in_flight": self.bytes_in_flight}

    def _refuse(self, reason: str, exc: type[web.HTTPException], **kw: Any) -> web.HTTPException:
        self.counters[f"refused_{reason}"] += 1
        return exc(**kw)

    def _token_ok(self, request: web.BaseRequest) -> bool:
        return hmac.compare_digest(request.headers.get("Authorization", "").encode(), self._token)

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: "continue" only to a token holder; anyone else gets the 401
        (and a closed connection) before a byte of its body is asked for."""
        if not self._token_ok(request):
            self.counters["refused_unauthorized"] += 1
            refused = web.Response(status=401, headers={"WWW-Authenticate": "Bearer"})
            refused.force_close()  # closed after its 401, as the door closes a stranger's
            return refused
        await _default_expect_handler(request)  # aiohttp's own: "100 Continue" or a 417
        return None

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not self._token_ok(request):
            raise self._refuse("unauthorized", web.HTTPUnauthorized,
                               headers={"WWW-Authenticate": "Bearer"})
        await self.door.authorized(request)  # its body in, within a deadline, before a slot
        if self.requests >= self.max_requests:
            raise self._refuse("busy", web.HTTPServiceUnavailable, headers={"Retry-After": "1"})
        self.requests += 1
        try:
            return await handler(request)
        finally:
            self.requests -= 1

    async def _metrics(self, request: web.Request) -> web.Response:
        from cachecd.daemon.metrics import peer_registry_for, render

        return web.Response(body=render(peer_registry_for(self.daemon)),
                            content_type="text/plain", charset="utf-8")

    async def _gone(self, request: web.Request) -> web.StreamResponse:
        raise self._refuse("old_protocol", web.HTTPGone, text=GONE)

    async def _one(self, request: web.Request) -> web.StreamResponse:
        opened = await self._open([(request.match_info["digest"], request.match_info["source"])])
        if opened[0] is None:
            raise self._refuse("not_found", web.HTTPNotFound)
        return await self._send(request, opened)

    async def _many(self, request: web.Request) -> web.StreamResponse:
        try:  # bounded: a token holder's 100,000-deep list is a 400, not a RecursionError
            asked = _asked(bounded_loads(await request.read(), "/v2/blobs", "body", 1 << 20),
                           self.max_experts)
        except (ValueError, ManifestInvalid):
            raise self._refuse("bad_request", web.HTTPBadRequest, text=(
                f"expected a JSON list of 1..{self.max_experts} "
                '{"digest": ..., "source": ...}')) from None
        return await self._send(request, await self._open(asked))

    async def _open(self, asked: list[tuple[str, str]]) -> list[tuple[int, int] | None]:
        out: list[tuple[int, int] | None] = []
        try:
            for digest, source in asked:
                if not DIGEST.match(digest) or not SOURCE.match(source):
                    self.counters["refused_bad_digest"] += 1
                    out.append(None)
                    continue
                out.append(await self._open_one(digest, source))
        except BaseException:
            _close(out)
            raise
        return out

    async def _open_one(self, digest: str, source: str) -> tuple[int, int] | None:
        if not self.daemon.store.has_source(digest, source):
            self.counters["refused_other_source"] += 1  # not verified as those bytes here
            return None
        try:
            return await self.daemon.open_verified_blob(digest)  # hashed first, as a hit's
        except ExpertNotFound:
            self.counters["refused_not_found"] += 1
            return None

    async def _send(self, request: web.Request,
                    opened: list[tuple[int, int] | None]) -> web.StreamResponse:
        total = sum(o[1] for o in opened if o is not None)
        if self.bytes_in_flight + total > self.max_bytes and self.bytes_in_flight:
            _close(opened)
            raise self._refuse("busy", web.HTTPServiceUnavailable, headers={"Retry-After": "1"})
        self.bytes_in_flight += total
        try:
            resp = web.StreamResponse(headers={
                "Content-Type": "application/octet-stream", "Content-Length": str(total),
                SIZES_HEADER: ",".join(str(o[1] if o else 0) for o in opened)})
            await resp.prepare(request)
            for item in opened:
                if item is not None:
                    await _send_fd(request, resp, *item)
            await resp.write_eof()
        finally:
            self.bytes_in_flight -= total
            _close(opened)
        served = [o for o in opened if o is not None]
        self.counters["served_experts"] += len(served)
        self.counters["served_bytes"] += total
        return resp


def _asked(body: Any, most: int) -> list[tuple[str, str]]:
    """(digest, source) of each blob a ``/v2/blobs`` body asks for; ValueError if malformed."""
    if not isinstance(body, list) or not 0 < len(body) <= most:
        raise ValueError("not a list of the right length")
    out = []
    for item in body:
        if (not isinstance(item, dict) or not isinstance(item.get("digest"), str)
                or not isinstance(item.get("source"), str)):
            raise ValueError("an item is not {digest, source}")
        out.append((item["digest"], item["source"]))
    return out


async def _send_fd(request: web.Request, resp: web.StreamResponse, fd: int, size: int) -> None:
    """``size`` bytes of ``fd`` to the client: sendfile(2) where the loop has it."""
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("the peer went away")
    with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
        try:
            await asyncio.get_running_loop().sendfile(transport, f, 0, size, fallback=False)
            return
        except (NotImplementedError, RuntimeError):
            pass  # TLS or a loop without it: read in chunks
        pos = 0
        while pos < size:
            chunk = await asyncio.to_thread(os.pread, f.fileno(), min(CHUNK, size - pos), pos)
            if not chunk:
                raise OSError(f"blob ended at {pos} of {size} bytes")
            await resp.write(chunk)
            pos += len(chunk)


def _close(opened: list[tuple[int, int] | None]) -> None:
    for item in opened:
        if item is not None:
            os.close(item[0])
