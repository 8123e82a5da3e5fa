"""ControlDoor's choice at the limit: which open connection a newcomer replaces, if any."""

from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp import web

from cachecd.daemon import control_door
from cachecd.daemon.control_door import ControlDoor


def _door(limit: int) -> tuple[ControlDoor, Counter[str]]:
    counters: Counter[str] = Counter()
    return ControlDoor(limit, counters, {}), counters


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False
        self.unsent = 0  # bytes of answers the kernel has not taken yet

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


async def _answer(request: web.BaseRequest) -> web.Response:
    return web.Response()


def _open(door: ControlDoor, server: web.Server, n: int) -> list:
    conns = []
    for _ in range(n):
        conn = door.admit(server)
        conn.connection_made(_Transport())
        conns.append(conn)
    return conns


def test_at_the_limit_the_door_replaces_unstarted_then_long_idle_connections() -> None:
    async def run() -> None:
        now = asyncio.get_running_loop().time()
        door, counters = _door(3)
        server = web.Server(_answer)
        a, b, c = _open(door, server, 3)
        for conn in (a, b, c):
            conn.started = True
        a.idle_since = now - 0.1  # answered just now
        b.active = 1  # a request under way
        c.idle_since = now - 0.2
        # Nothing to replace: every connection is busy or was answered just now.
        assert not isinstance(door.admit(server), control_door._Counted)
        assert counters["control_connections_refused"] == 1
        # Idle long enough, but its last answer is not all out yet: it stays.
        a.idle_since = now - control_door.IDLE_CLOSE_AFTER_S - 2
        a.transport.unsent = 1
        assert not isinstance(door.admit(server), control_door._Counted)
        # Idle long enough: the one idle longest goes, a newcomer takes its place.
        a.transport.unsent = 0
        c.idle_since = now - control_door.IDLE_CLOSE_AFTER_S - 1
        new = door.admit(server)
        assert isinstance(new, control_door._Counted)
        assert a.transport.closed and not c.transport.closed and not b.transport.closed
        assert counters["control_connections_idle_closed"] == 1
        # A connection that never started a request goes before any idle one.
        new.connection_made(_Transport())
        door.admit(server).connection_made(_Transport())
        assert new.transport.closed and not c.transport.closed
        assert counters["control_connections_dropped"] == 1

    asyncio.run(run())
