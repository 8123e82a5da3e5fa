"""ForwardProxy: an HTTP forward proxy on 127.0.0.1:0, what ``HTTP_PROXY`` points at on a proxied
network. It takes absolute-form requests (``GET http://host:port/path``), sends each on to the
host it names, streams the answer back unchanged (status, headers, bytes; no redirect followed)
and records ``(method, url)`` of every request that passed through. CONNECT (HTTPS tunnels) is
answered 405 and recorded: the local hubs are plain HTTP.

Runs on its own event loop in a daemon thread, so a synchronous test can start it beside a
daemon subprocess.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Self

import aiohttp
from aiohttp import web
from yarl import URL

# Hop-by-hop headers (RFC 9110 7.6.1) are the proxy's own, not forwarded either way.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
        "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host"}


class ForwardProxy:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.ServerRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> Self:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _start(self) -> None:
        # trust_env off: the proxy itself must not go through a proxy of the test's environment.
        self._session = aiohttp.ClientSession(auto_decompress=False, trust_env=False)
        self._runner = web.ServerRunner(web.Server(self._forward))
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.BaseRequest) -> web.StreamResponse:
        target = URL(request.raw_path)  # absolute-form: the whole URL is the request target
        self.requests.append((request.method, str(target)))
        if request.method == "CONNECT" or not target.is_absolute():
            return web.Response(status=405, text="this proxy forwards absolute-form http only")
        return (await self._relay(request, target, HOP_BY_HOP))[0]

    async def _relay(self, request: web.BaseRequest, target: URL | str,
                     hop: set[str]) -> tuple[web.StreamResponse, int, int]:
        """``request`` sent on to ``target`` without the ``hop`` headers either way, its answer
        streamed back; (the response, the upstream status, the body bytes passed on)."""
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
        async with self._session.request(
            request.method, target, headers=headers, data=await request.read() or None,
            allow_redirects=False,
        ) as upstream:
            out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in hop:
                    out.headers.add(k, v)
            await out.prepare(request)
            nbytes = 0
            if request.method != "HEAD":
                async for chunk in upstream.content.iter_any():
                    nbytes += len(chunk)
                    await out.write(chunk)
            await out.write_eof()
            return out, upstream.status, nbytes
