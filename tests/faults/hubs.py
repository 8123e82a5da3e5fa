"""The fault suite's upstream: FakeHub that times its stalls, on its own loop, with proxies.

A ``HubThread`` owns one event loop in a daemon thread; the hub and every FaultProxy put in front
of it run there. ``stop`` cancels handlers still sleeping in a delay or a stall, so the loop
closes with no task pending.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from tests.fakes.fake_hub import FakeHub, FakeHubThread
from tests.fakes.fault_proxy import FaultProxy

# As fake_hub.ARRIVAL: a typed request key where aiohttp has them, else a string.
_SENDING: Any = (web.RequestKey("t_sending", float) if hasattr(web, "RequestKey")
                 else "t_sending")


class RecordingHub(FakeHub):
    """FakeHub that also times each stall: from just before the bytes ahead of it were sent to
    the client hanging up. Stamped before the send, so a loaded machine that delays this thread
    can only lengthen a window, never shorten it below the client's own timeout."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.stalls: list[tuple[float, float]] = []

    async def _write(self, request: Any, resp: Any, body: memoryview) -> None:
        request[_SENDING] = time.monotonic()  # a cut body is one chunk: this is its last send
        await super()._write(request, resp, body)

    async def _fault(self, request: Any, what: str) -> None:
        await super()._fault(request, what)
        if what == "stall":
            self.stalls.append((request[_SENDING], time.monotonic()))


class HubThread(FakeHubThread):
    """A RecordingHub on its own loop; ``proxy()`` puts a FaultProxy in front of its CDN URLs."""

    hub_cls: type[RecordingHub] = RecordingHub

    async def _make(self) -> FakeHub:
        hub = self.hub_cls(self._folder, **self._kw)
        await hub.start()
        return hub

    def proxy(self) -> FaultProxy:
        port = int(self.hub.url.rsplit(":", 1)[1])
        proxy = self._call(self._start_proxy(port))
        self.hub.public_url = proxy.url
        self._proxies = [*getattr(self, "_proxies", []), proxy]
        return proxy

    async def _start_proxy(self, port: int) -> FaultProxy:
        proxy = FaultProxy("127.0.0.1", port)
        await proxy.start()
        return proxy

    def stop(self) -> None:
        for proxy in getattr(self, "_proxies", []):
            self._call(proxy.close())
        self._call(self.hub.close())
        self._call(self._cancel_rest())  # handlers still sleeping in a delay or a stall
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _cancel_rest(self) -> None:
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)


class HostileHub(RecordingHub):
    """An endpoint that answers as an attacker would (scenario 16), for the repos in ``aliases``
    besides its own, all served from its one folder:

    - ``api[repo]``: the bytes ``/api/models/{repo}/revision/{rev}`` answers with (200), gzip
      encoded as they are for a repo in ``api_gzip_for``; ``api_stall_after``: that many bytes, then nothing
      until ``release()`` (or the hub closes). A repo not in ``api`` gets 404, as from an
      endpoint without that API.
    - ``resolve_header``: a header of this many bytes on every /resolve (aiohttp's client refuses
      one over 8,190); ``resolve_to``: the Location every /resolve redirects to instead.
    """

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.aliases: set[str] = set()
        self.api: dict[str, bytes] = {}
        self.api_gzip_for: set[str] = set()  # repos whose answer is sent gzip encoded
        self.api_stall_after: int | None = None
        self.api_stalled = 0  # answers stalled so far (the test waits on it)
        self.api_open = 0  # stalled answers whose client is still connected
        self._released = False
        self.resolve_header = 0
        self.resolve_to: str | None = None

    def release(self) -> None:
        self._released = True

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._api)

    def _file(self, request: web.Request) -> Any:
        m = request.match_info
        if f"{m['org']}/{m['name']}" in self.aliases:  # the same bytes under another name
            m = {**m, "org": self.repo.split("/")[0], "name": self.repo.split("/")[1]}
            file = m["file"]
            path = self.folder / file
            return path if ".." not in file.split("/") and path.is_file() else None
        return super()._file(request)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        resp = await super()._resolve(request)
        if self.resolve_to is not None and resp.status == 302:
            resp.headers["Location"] = self.resolve_to
        if self.resolve_header:
            resp.headers["X-Padding"] = "x" * self.resolve_header
        return resp

    async def _api(self, request: web.Request) -> web.StreamResponse:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        body = self.api.get(repo)
        if body is None:
            return web.Response(status=404, text='{"error": "no metadata API here"}')
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        if repo in self.api_gzip_for:
            headers["Content-Encoding"] = "gzip"
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        if self.api_stall_after is None:
            await resp.write(body)
            return resp
        await resp.write(body[: self.api_stall_after])
        self.api_stalled += 1
        self.api_open += 1
        try:
            while not self._released and not self._closing.is_set():
                if request.transport is None or request.transport.is_closing():
                    return resp  # the client gave up on it
                await asyncio.sleep(0.02)  # a stalled body: the client waits on its read timeout
            await resp.write(body[self.api_stall_after:])
        finally:
            self.api_open -= 1
        return resp


class ScriptedPeer:
    """A hostile peer: another daemon's ``--share`` that answers each ``/v2/blobs`` with the
    next status of ``script`` (then 401), on ``thread``'s loop."""

    def __init__(self, thread: HubThread, script: list[int]) -> None:
        self.script = list(script)
        self.answered: list[int] = []
        self._thread = thread
        self.url = thread._call(self._start())

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_post("/v2/blobs", self._blobs)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def _blobs(self, request: web.Request) -> web.Response:
        await request.read()
        status = self.script.pop(0) if self.script else 401
        self.answered.append(status)
        return web.Response(status=status, headers={"Retry-After": "1"} if status == 503 else {})

    def stop(self) -> None:
        self._thread._call(self._runner.cleanup())
