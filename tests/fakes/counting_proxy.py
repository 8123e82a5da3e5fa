"""CountingProxy: a reverse proxy on 127.0.0.1:0 in front of a local hub that records every request
it passes on: ``(method, path, Range header, status, body bytes)``. The Host header goes on
unchanged, so the hub's absolute redirects (``/resolve`` -> ``/_cdn``) point back at the proxy
and every byte a client reads of the hub is counted here.

Runs on its own event loop in a daemon thread, beside daemon and CLI subprocesses.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Self

import aiohttp
from aiohttp import web

_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
        "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    range: str | None
    status: int
    nbytes: int


class CountingProxy:
    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.seen: list[Seen] = []
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

    def mark(self) -> int:
        return len(self.seen)

    def ranges(self, since: int = 0) -> list[Seen]:
        """The range reads of safetensors files answered, from ``since`` on."""
        return [s for s in self.seen[since:]
                if s.range and s.path.endswith(".safetensors") and s.status == 206]

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False, trust_env=False)
        self._runner = web.ServerRunner(web.Server(self._forward))
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.BaseRequest) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self._session.request(
            request.method, self.target + request.raw_path, headers=headers,
            data=await request.read() or None, allow_redirects=False,
        ) as upstream:
            out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP:
                    out.headers.add(k, v)
            await out.prepare(request)
            nbytes = 0
            if request.method != "HEAD":
                async for chunk in upstream.content.iter_any():
                    nbytes += len(chunk)
                    await out.write(chunk)
            await out.write_eof()
            self.seen.append(Seen(request.method, request.path, request.headers.get("Range"),
                                  upstream.status, nbytes))
            return out
