"""The control socket's door: a bound on open connections that slow clients cannot hold.

aiohttp's server admits every connection it accepts. A client that opens connections and never
finishes a request (slowloris) holds a file descriptor with each until aiohttp's keep-alive
timer closes it, 75 s later. The door keeps the count at ``limit``:
- a connection that arrives at the limit pushes out the oldest open connection that has not
  started a request (its headers never completed), so a health check still gets in;
- failing that, the connection idle longest among those kept alive after their last answer, if
  that was ``IDLE_CLOSE_AFTER_S`` ago or more (HTTP lets a server close an idle kept-alive
  connection at any time; cachecd's client resends on a fresh one);
- when every open connection has a request under way or answered within that time, the
  newcomer is answered with a typed 503 (``too_many_connections``) once its request has
  arrived, and closed.
A request under way is never cut. The data socket bounds its connections itself (datapath).

The door also builds each connection's aiohttp handler, as ``_JsonErrors``: what aiohttp answers
on its own (a request it cannot parse, an oversized header line) comes in cachecd's typed JSON
error form too, not as text/plain.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from cachecd.errors import Internal, InvalidRequest, TooManyConnections

# A refused client gets this long to send its request and read the 503 before it is closed.
REFUSAL_WAIT_S = 2.0
# A kept-alive connection may be closed for a newcomer once its last answer is this old: long
# after aiohttp has written a control answer, short of the 75 s its keep-alive timer waits.
IDLE_CLOSE_AFTER_S = 1.0
_MAX_REFUSED_HEAD = 16 << 10


class ControlDoor:
    def __init__(self, limit: int, counters: Counter[str], handler_args: dict[str, Any]) -> None:
        self.limit = limit
        self._counters = counters
        self._handler_args = handler_args  # the runner's too: the handlers aiohttp would build
        # Open connections, oldest first. Counted here and not from aiohttp's list: asyncio
        # accepts a burst of connections before any of them reaches connection_made.
        self._open: dict[_Counted, None] = {}
        self._by_handler: dict[RequestHandler, _Counted] = {}

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        conn = self._by_handler.get(request.protocol)
        if conn is None:
            return await handler(request)
        conn.started = True
        conn.active += 1
        try:
            return await handler(request)
        finally:
            conn.active -= 1
            conn.idle_since = asyncio.get_running_loop().time()

    def admit(self, server: web.Server) -> asyncio.BaseProtocol:
        """The protocol for a connection just accepted (an asyncio protocol factory's job)."""
        if len(self._open) >= self.limit:
            out = self._to_close()
            if out is None:
                self._counters["control_connections_refused"] += 1
                return _Refusal(self.limit)
            conn, counter = out
            self._forget(conn)
            conn.handler.force_close()
            self._counters[counter] += 1
        handler = _JsonErrors(server, loop=asyncio.get_running_loop(), **self._handler_args)
        conn = _Counted(handler, self)
        self._open[conn] = None
        self._by_handler[conn.handler] = conn
        return conn

    def _to_close(self) -> tuple[_Counted, str] | None:
        """The connection a newcomer at the limit replaces, and the counter that records it."""
        slow = next((c for c in self._open if not c.started and c.transport), None)
        if slow is not None:
            return slow, "control_connections_dropped"
        cutoff = asyncio.get_running_loop().time() - IDLE_CLOSE_AFTER_S
        idle = [c for c in self._open if c.idle_since <= cutoff and not c.active and c.flushed()]
        if idle:
            return min(idle, key=lambda c: c.idle_since), "control_connections_idle_closed"
        return None

    def _forget(self, conn: _Counted) -> None:
        self._open.pop(conn, None)
        self._by_handler.pop(conn.handler, None)


class _JsonErrors(RequestHandler):
    """aiohttp's connection handler, with its own error answers in the typed JSON form."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, ConnectionResetError) and (
            request.transport is None or request.transport.is_closing()
        ):
            # The client left before its request was in (a half-sent body): nothing to answer
            # and nothing wrong here. aiohttp takes this as a premature disconnection (debug).
            raise ConnectionResetError("the client closed its connection mid-request") from exc
        super().handle_error(request, status, exc, message)  # logs; refuses if a reply began
        # aiohttp's message can quote the request's bytes: name the failure, not the input.
        what = type(exc).__name__ if exc is not None else "an unreadable request"
        err = (
            InvalidRequest(f"the daemon could not parse this HTTP request ({what})")
            if 400 <= status < 500
            else Internal(f"the daemon failed on this request ({what}); its log says more")
        )
        resp = web.json_response(err.to_wire(), status=status)
        resp.force_close()
        return resp


class _Counted(asyncio.Protocol):
    """aiohttp's handler for one connection, behind a wrapper that tells the door when it ends."""

    def __init__(self, handler: RequestHandler, door: ControlDoor) -> None:
        self.handler = handler
        self.started = False  # a request got as far as the app
        self.active = 0  # requests in the app now
        self.idle_since = math.inf  # loop time its last request left the app
        self.transport: asyncio.BaseTransport | None = None
        self._door = door

    def flushed(self) -> bool:
        """Open, with every byte of its answers handed to the kernel (a slow reader's last
        answer may still sit in the transport's buffer after its handler returned)."""
        t = self.transport
        return isinstance(t, asyncio.WriteTransport) and t.get_write_buffer_size() == 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._door._forget(self)
        self.transport = None
        self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.handler.data_received(data)

    def eof_received(self) -> None:
        self.handler.eof_received()  # None: the transport closes its side

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


class ControlSite(web.SockSite):
    """aiohttp's site for an already bound socket, with every accept going through the door."""

    def __init__(self, runner: web.BaseRunner, sock: object, door: ControlDoor) -> None:
        super().__init__(runner, sock)  # type: ignore[arg-type]
        self._door = door

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; SockSite.start would bind its own
        server = self._runner.server
        assert isinstance(server, web.Server)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: self._door.admit(server), sock=self._sock, backlog=self._backlog
        )


class _Refusal(asyncio.Protocol):
    """Reads the request head, answers 503 with the typed error, closes."""

    def __init__(self, limit: int) -> None:
        err = TooManyConnections(
            f"the daemon already serves its limit of {limit} control connections, each with a "
            f"request under way or just answered; retry in a moment, or find what holds them "
            f"(`ss -xp | grep cachecd`)"
        )
        body = json.dumps(err.to_wire()).encode()
        self._answer = (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nRetry-After: 1\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        self._head = b""
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(REFUSAL_WAIT_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        self._head += data
        # Answering before the head is in could break the client's send of it (EPIPE), and
        # it would report a daemon that is not there.
        if b"\r\n\r\n" in self._head or len(self._head) > _MAX_REFUSED_HEAD:
            self._transport.write(self._answer)
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport = None
