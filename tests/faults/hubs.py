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
