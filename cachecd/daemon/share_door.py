"""The share's door (``serve --share``): a stranger on the LAN cannot hold it shut.

The share listens on TCP, where anyone who can reach the address may connect; aiohttp admits
every connection it accepts and keeps a silent one for an hour. Left so, idle connections with
no token took the daemon to "Too many open files" (local clients' reads failed with it). The
door keeps the share's connections within a budget of file descriptors:

- ``limit`` connections at most, an eighth of the soft fd limit (``connection_limit``): the rest
  stays for local clients, the cache's blobs and the upstream. ``serve`` raises the soft fd limit
  to the hard one first, up to 65,536 (``raise_fd_limit``).
- One address holds at most ``per_address`` of them.
- The listening socket's backlog is ``backlog``, a quarter of the limit: asyncio accepts up to
  a backlog of connections at once before the door sees any, so that is what a burst can hold
  beyond the limit for a moment (the kernel keeps the rest of a flood waiting, not the daemon).
- A connection must send its request head within ``HEADER_S`` of arriving, and its body within
  ``BODY_S`` once its token passed (before the request takes one of the share's request slots),
  and a kept-alive connection is closed after ``IDLE_S`` without a request. A wrong token
  closes the connection with its 401.
- A newcomer past either bound pushes out the oldest connection that never showed the token
  (from the address holding the most, for the total bound), else one idle longest since its last
  answer; when every connection holds a request under way or just answered, the newcomer is
  closed at once. A request under way is never cut by a newcomer.
- Token holders keep their share of the door under churn: an address a request showed the
  right token from (the last ``TRUSTED_ADDRESSES`` of them) is trusted, and a new connection
  from it is not a stranger's: strangers' newcomers never push it out before its request head
  has been read, so however fast they churn, a peer's reconnection is served. A wrong token
  from a trusted address ends its trust.
- What the door does is counted (``connections_*`` in the share's status) and logged at most one
  line per ``LOG_EVERY_S``, however many connections a flood opens; so is a request aiohttp
  cannot parse (``connections_malformed``), which it would log a line for each.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import resource
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from cachecd import constants

log = logging.getLogger(__name__)

HEADER_S = constants.SHARE_HEADER_DEADLINE_S
BODY_S = constants.SHARE_BODY_DEADLINE_S
IDLE_S = constants.SHARE_IDLE_DEADLINE_S
# An authorized connection may be closed for a newcomer once its last answer is this old.
IDLE_CLOSE_AFTER_S = 1.0
LOG_EVERY_S = 10.0
TRUSTED_ADDRESSES = 256  # addresses remembered for having shown the token, the latest kept
# Far more than the daemon's bounds add up to (control 128, data 256, share 128, blob fds 256,
# upstream); a modest ceiling, as an unlimited hard limit (launchd's) cannot be a soft one.
_FD_CEILING = 65536


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard one, up to ``_FD_CEILING`` (within what
    the OS accepts: macOS refuses more than OPEN_MAX, 10,240); return
    the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else _FD_CEILING, _FD_CEILING)
    for target in (want, 10240):  # 10240: macOS's OPEN_MAX, where the kernel refuses more
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
            break
        except (ValueError, OSError):
            continue
    return soft


def connection_limit(soft_fds: int | None = None) -> tuple[int, int]:
    """(connections the share may hold, of which one address at most) for a soft fd limit
    (None: this process's)."""
    if soft_fds is None:
        soft_fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limit = max(constants.SHARE_MIN_CONNECTIONS,
                min(constants.SHARE_MAX_CONNECTIONS, soft_fds // 8))
    return limit, max(constants.SHARE_MIN_CONNECTIONS // 2, limit // 2)


def exposure(host_port: str) -> str | None:
    """What is wrong with sharing on ``host_port``, if anything: a wildcard (every interface) or
    a public address (reachable from the Internet). None for a private, link-local or loopback
    address, which is what a LAN or a Thunderbolt bridge gives."""
    host = host_port.rpartition(":")[0].strip("[]")
    try:
        addresses = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            addresses = {ipaddress.ip_address(str(info[4][0]).split("%")[0])
                         for info in socket.getaddrinfo(host, None)}
        except (OSError, ValueError):
            return None  # binding says what is wrong with it
    if not host or any(a.is_unspecified for a in addresses):
        return (f"--share {host_port} listens on every interface: anyone who can reach this "
                "machine can connect and try the token. Give the LAN's or the bridge's address "
                "(docs/sharing.md)")
    public = sorted(str(a) for a in addresses
                    if not (a.is_private or a.is_loopback or a.is_link_local))
    if public:
        return (f"--share {host_port} is a public address ({', '.join(public)}): anyone on the "
                "Internet who can reach it can connect and try the token, and the experts and "
                "the token cross it in the clear. Share on a private address, or through a "
                "tunnel (docs/sharing.md)")
    return None


class ShareDoor:
    def __init__(self, counters: Counter[str], limit: int, per_address: int) -> None:
        self.limit, self.per_address = limit, per_address
        self.backlog = max(4, limit // 4)
        self.counters = counters
        self._open: dict[_Conn, None] = {}  # oldest first
        self._by_handler: dict[RequestHandler, _Conn] = {}
        self._unsaid: Counter[str] = Counter()
        self._say_handle: asyncio.TimerHandle | None = None
        self._trusted: dict[str, None] = {}  # addresses that showed the token, oldest first

    def admit(self, server: web.Server) -> asyncio.BaseProtocol:
        """A protocol factory: the connection's fate is decided once its address is known."""
        handler = _Quiet(self, server, loop=asyncio.get_running_loop(), access_log=None)
        return _Conn(handler, self)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        conn = self._by_handler.get(request.protocol)
        if conn is None:  # a connection that did not come through the door (tests)
            return await handler(request)
        conn.begin()
        try:
            return await handler(request)
        except web.HTTPUnauthorized as exc:
            conn.authorized = conn.trusted = False
            self._trusted.pop(conn.address, None)  # a wrong token: its address is a stranger's
            exc.force_close()  # closed after its 401: a stranger keeps nothing open
            raise
        finally:
            conn.end()

    async def authorized(self, request: web.Request) -> None:
        """The token passed: the body must be in within ``BODY_S`` (before the request counts
        against the share's request bound, so stalled bodies cannot hold it)."""
        conn = self._by_handler.get(request.protocol)
        if conn is not None:
            conn.authorized = True
            self.trust(conn.address)
        if not request.can_read_body:
            return
        try:
            async with asyncio.timeout(BODY_S):
                await request.read()  # kept by aiohttp: the handler's read() gets it
        except TimeoutError:
            self.note("body_timed_out")
            request.protocol.force_close()
            raise web.HTTPRequestTimeout() from None
        except ConnectionResetError:  # it hung up mid-body: counted, no traceback in the log
            self.note("body_lost")
            raise web.HTTPBadRequest() from None

    def trust(self, address: str) -> None:
        self._trusted.pop(address, None)
        self._trusted[address] = None
        if len(self._trusted) > TRUSTED_ADDRESSES:
            del self._trusted[next(iter(self._trusted))]

    def arrive(self, conn: _Conn) -> bool:
        """Whether a connection just made is kept, after pushing out another if need be."""
        conn.trusted = conn.address in self._trusted
        mine = [c for c in self._open if c.address == conn.address]
        victim: _Conn | None = None
        if len(mine) >= self.per_address:
            victim = self._victim(mine)
            if victim is None:
                self.note("refused")
                return False
        elif len(self._open) >= self.limit:
            victim = self._victim(self._busiest_first())
            if victim is None:
                self.note("refused")
                return False
        if victim is not None:
            self.note("dropped" if not victim.authorized else "idle_closed")
            victim.close()
        self._open[conn] = None
        self._by_handler[conn.handler] = conn
        return True

    def _busiest_first(self) -> list[_Conn]:
        held = Counter(c.address for c in self._open)
        return sorted(self._open, key=lambda c: -held[c.address])  # stable: oldest first within

    def _victim(self, among: list[_Conn]) -> _Conn | None:
        stranger = next((c for c in among if not (c.authorized or c.trusted or c.active)), None)
        if stranger is not None:
            return stranger
        cutoff = asyncio.get_running_loop().time() - IDLE_CLOSE_AFTER_S
        idle = [c for c in among if not c.active and c.idle_since <= cutoff]
        return min(idle, key=lambda c: c.idle_since) if idle else None

    def forget(self, conn: _Conn) -> None:
        self._open.pop(conn, None)
        self._by_handler.pop(conn.handler, None)

    def note(self, what: str) -> None:
        """Count ``connections_<what>``; log it within one line per ``LOG_EVERY_S``."""
        self.counters[f"connections_{what}"] += 1
        self._unsaid[what] += 1
        if self._say_handle is None:
            self._say()

    def _say(self) -> None:
        if not self._unsaid:
            self._say_handle = None
            return
        said = " ".join(f"{k}={v}" for k, v in sorted(self._unsaid.items()))
        log.warning("share door connections %s open=%d limit=%d per_address=%d (counts since "
                    "the last such line, at most one every %.0fs)", said, len(self._open),
                    self.limit, self.per_address, LOG_EVERY_S)
        self._unsaid.clear()
        self._say_handle = asyncio.get_running_loop().call_later(LOG_EVERY_S, self._say)

    def close(self) -> None:
        if self._say_handle is not None:
            self._say_handle.cancel()
            self._say_handle = None

    def status(self) -> dict[str, int]:
        return {"connections": len(self._open), "connection_limit": self.limit}


class _Quiet(RequestHandler):
    """aiohttp's handler, whose malformed requests are counted by the door, not logged each."""

    def __init__(self, door: ShareDoor, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._door = door

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            self._door.note("malformed")  # already answered 4xx; a stranger's junk, counted
            return
        super().log_exception(*args, **kw)


class _Conn(asyncio.Protocol):
    """aiohttp's handler for one connection, with its deadlines, behind the door."""

    def __init__(self, handler: RequestHandler, door: ShareDoor) -> None:
        self.handler, self._door = handler, door
        self.address: str = ""
        self.authorized = False  # a request of it showed the right token
        self.trusted = False  # it came from an address that showed the token before
        self.active = 0  # its requests in the app now
        self.idle_since = math.inf
        self.transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        if not self._door.arrive(self):
            assert isinstance(transport, asyncio.Transport)
            transport.abort()  # RST now: a refused connection holds nothing, not even TIME_WAIT
            return
        self.transport = transport
        self._arm(HEADER_S, "header_timed_out")
        self.handler.connection_made(transport)

    def _arm(self, seconds: float, what: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire, what)

    def _expire(self, what: str) -> None:
        self._timer = None
        if self.transport is not None and not self.active:
            self._door.note(what)
            self.close()

    def begin(self) -> None:
        self.active += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def end(self) -> None:
        self.active -= 1
        if not self.active and self.transport is not None:
            self.idle_since = asyncio.get_running_loop().time()
            self._arm(IDLE_S, "idle_timed_out")

    def close(self) -> None:
        self._door.forget(self)
        self.handler.force_close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._door.forget(self)
        if self.transport is not None:
            self.transport = None
            self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.handler.data_received(data)

    def eof_received(self) -> None:
        self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


class ShareSite(web.TCPSite):
    """aiohttp's TCP site, with every accepted connection going through the door."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, door: ShareDoor) -> None:
        super().__init__(runner, host, port, reuse_address=True, backlog=door.backlog)
        self._door = door

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; TCPSite.start would serve without us
        server = self._runner.server
        assert isinstance(server, web.Server)
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self._door.admit(server), self._host, self._port,
            backlog=self._backlog, reuse_address=self._reuse_address)
