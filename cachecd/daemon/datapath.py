"""The zero-copy data path: expert bytes handed to the client as open file descriptors.

The daemon never copies a hit's bytes: it opens each blob (or dups an fd it keeps for it, see
``app.BlobFds``), passes the fd (SCM_RIGHTS) and closes its own copy. An eviction unlinks the
blob's name only, so a client that holds the fd reads the whole blob even if it is evicted
meanwhile. Each connection carries one request at a time; the
client opens several connections to read in parallel. Frames: see ``protocol``.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from cachecd import protocol
from cachecd.daemon.peer import peer_cred
from cachecd.errors import CachecdError, Forbidden, Internal, InvalidRequest

if TYPE_CHECKING:
    from cachecd.daemon.app import Daemon, Uses

log = logging.getLogger(__name__)

_RECV_SIZE = 64 * 1024


async def _recv_frame(loop: asyncio.AbstractEventLoop, conn: socket.socket,
                      reader: protocol.FrameReader) -> bytes | None:
    """The next frame's body; ``reader`` keeps bytes read past it. None at a clean end of stream.

    One receive usually brings the header and the body together (a client sends one frame and
    waits), so a request costs one read, not two."""
    while (body := reader.next()) is None:
        chunk = await loop.sock_recv(conn, max(_RECV_SIZE, reader.want()))
        if not chunk:
            return None
        reader.feed(chunk)
    return body


async def _send_with_fds(loop: asyncio.AbstractEventLoop, conn: socket.socket, data: bytes,
                         fds: list[int]) -> None:
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _pack_fds(fds))] if fds else []
    while True:
        try:
            sent = conn.sendmsg([data], ancillary)
            break
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_writer(conn.fileno(), ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_writer(conn.fileno())
    if sent < len(data):  # the fds went with the first byte; the rest is plain data
        await loop.sock_sendall(conn, data[sent:])


def _pack_fds(fds: list[int]) -> bytes:
    return array.array("i", fds).tobytes()


class DataServer:
    def __init__(self, daemon: Daemon, sock: socket.socket) -> None:
        self._daemon = daemon
        self._sock = sock
        self._conns: set[asyncio.Task[None]] = set()
        self._accept_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            if len(self._conns) >= self._daemon.max_connections:
                conn.close()
                self._daemon.counters["data_connections_refused"] += 1
                continue
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            cred = peer_cred(conn)
            if cred.uid != os.getuid():
                log.warning("data peer refused uid=%d pid=%d", cred.uid, cred.pid)
                err = Forbidden(f"uid {cred.uid} may not use this daemon (it runs as uid {os.getuid()})")
                await loop.sock_sendall(conn, protocol.encode({"ok": False, **err.to_wire()}))
                return
            reader = protocol.FrameReader()
            while True:
                body = await _recv_frame(loop, conn, reader)
                if body is None:
                    return
                await self._answer(loop, conn, body)
        except (ConnectionError, OSError) as exc:
            log.debug("data connection closed err=%r", exc)
        except CachecdError as exc:  # a bad frame header: answer once, then hang up
            await _safe_send(loop, conn, {"ok": False, **exc.to_wire()})
        finally:
            conn.close()

    async def _answer(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, body: bytes) -> None:
        fds: list[int] = []
        uses: Uses | None = None
        started = time.monotonic()
        try:
            frame, fds, uses, missed = await self._handle(protocol.decode(body))
            await _send_with_fds(loop, conn, frame, fds)
            self._daemon.latency.request(time.monotonic() - started, missed)
        except CachecdError as exc:
            await _safe_send(loop, conn, {"ok": False, **exc.to_wire()})
        except (ConnectionError, OSError):
            raise
        except Exception as exc:
            log.exception("data path request failed")
            await _safe_send(loop, conn, {"ok": False, **Internal(repr(exc)).to_wire()})
        finally:
            for fd in fds:
                os.close(fd)
            if uses is not None:  # after the answer left: the client reads meanwhile
                self._daemon.record_uses(uses)

    async def _handle(self, req: dict[str, Any]) -> tuple[bytes, list[int], Uses, bool]:
        if req.get("op") != "experts":
            raise InvalidRequest(f"unknown op {req.get('op')!r}; the data path knows 'experts'")
        ids = req.get("ids")
        if not isinstance(ids, list) or len(ids) > protocol.MAX_FDS_PER_FRAME:
            raise InvalidRequest(f"ids must be a list of at most {protocol.MAX_FDS_PER_FRAME} experts")
        opened, uses = await self._daemon.open_unrecorded(str(req.get("model", "")),
                                                          req.get("layer"), ids,
                                                          warm=req.get("warm") is True)
        fds = [o.fd for o in opened]
        try:
            frame = protocol.encode_experts([(o.expert, o.size, o.fetched) for o in opened])
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return frame, fds, uses, any(o.fetched for o in opened)

    async def close(self) -> None:
        if self._accept_task:
            self._accept_task.cancel()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, *( [self._accept_task] if self._accept_task else []),
                             return_exceptions=True)
        self._daemon.blob_fds.clear()
        self._sock.close()


async def _safe_send(loop: asyncio.AbstractEventLoop, conn: socket.socket, payload: dict[str, Any]) -> None:
    try:
        await loop.sock_sendall(conn, protocol.encode(payload))
    except OSError:
        pass
