"""CountingProxy: a reverse proxy on 127.0.0.1:0 in front of a local hub that records every request
it passes on: ``(method, path, Range header, status, body bytes)``. The Host header goes on
unchanged, so the hub's absolute redirects (``/resolve`` -> ``/_cdn``) point back at the proxy
and every byte a client reads of the hub is counted here.

Runs on its own event loop in a daemon thread, beside daemon and CLI subprocesses.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from tests.fakes.forward_proxy import HOP_BY_HOP, ForwardProxy

# The Host header goes on: the hub's absolute redirects must point back at this proxy.
_HOP = HOP_BY_HOP - {"host"}


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    range: str | None
    status: int
    nbytes: int


class CountingProxy(ForwardProxy):
    """ForwardProxy's loop, thread and relay, as a reverse proxy in front of ``target``."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target.rstrip("/")
        self.seen: list[Seen] = []

    def mark(self) -> int:
        return len(self.seen)

    def ranges(self, since: int = 0) -> list[Seen]:
        """The range reads of safetensors files answered, from ``since`` on."""
        return [s for s in self.seen[since:]
                if s.range and s.path.endswith(".safetensors") and s.status == 206]

    async def _forward(self, request: web.BaseRequest) -> web.StreamResponse:
        out, status, nbytes = await self._relay(request, self.target + request.raw_path, _HOP)
        self.seen.append(Seen(request.method, request.path, request.headers.get("Range"),
                              status, nbytes))
        return out
