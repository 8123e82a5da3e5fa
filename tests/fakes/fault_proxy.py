"""FaultProxy: an asyncio TCP proxy on 127.0.0.1:0 with toxiproxy's toxics, for the
server-to-client direction: latency, bandwidth, timeout (stall), slicer, limit_data, reset_peer.

Toxics apply to the first ``toxics.connections`` accepted connections (None: all), so a test can
make a fault transient. ``accepted`` counts connections, ``toxic_hits`` how often a toxic cut one.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass
from typing import Self


@dataclass
class Toxics:
    latency: float = 0.0  # seconds before each chunk is forwarded
    bandwidth: int = 0  # bytes per second; 0 = unlimited
    timeout: float | None = None  # stop forwarding; close after this many seconds (0 = never)
    slicer: int = 0  # forward in slices of this many bytes...
    slice_delay: float = 0.0  # ...with this pause between them
    limit_data: int | None = None  # close (FIN) after this many bytes
    reset_peer: int | None = None  # after this many bytes, reset the client (SO_LINGER 0 + close)
    connections: int | None = None  # how many connections get the toxics


class FaultProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.toxics = Toxics()
        self.accepted = 0
        self.toxic_hits = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._closing = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.url

    async def close(self) -> None:
        self._closing.set()
        if self._server is not None:
            self._server.close()
        # Closing the sockets ends the pipes; cancelling the handler tasks would make asyncio
        # (3.11) log a spurious "Unhandled exception in client_connected_cb".
        for w in list(self._writers):
            w.transport.abort()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        toxic = self.toxics.connections is None or self.accepted <= self.toxics.connections
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            self._tasks.discard(task)
            return
        self._writers.update((writer, up_w))
        try:
            await asyncio.gather(self._pipe(reader, up_w, None), self._pipe(up_r, writer, toxic))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._tasks.discard(task)
            for w in (writer, up_w):
                w.close()
                self._writers.discard(w)

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, toxic: bool | None
    ) -> None:
        sent = 0
        while data := await src.read(64 * 1024):
            if toxic:
                data = await self._delay(data, sent)
                if await self._cut(dst, data, sent):
                    return
                for i in range(0, len(data), self.toxics.slicer or len(data)):
                    dst.write(data[i : i + (self.toxics.slicer or len(data))])
                    await dst.drain()
                    if self.toxics.slice_delay:
                        await asyncio.sleep(self.toxics.slice_delay)
            else:
                dst.write(data)
                await dst.drain()
            sent += len(data)
        if dst.can_write_eof():
            dst.write_eof()

    async def _delay(self, data: bytes, sent: int) -> bytes:
        t = self.toxics
        if t.latency:
            await asyncio.sleep(t.latency)
        if t.bandwidth:
            await asyncio.sleep(len(data) / t.bandwidth)
        if t.timeout is not None:
            self.toxic_hits += 1
            try:
                await asyncio.wait_for(self._closing.wait(), t.timeout if t.timeout > 0 else None)
            except TimeoutError:
                pass
            raise OSError("timeout toxic closed the connection")
        return data

    async def _cut(self, dst: asyncio.StreamWriter, data: bytes, sent: int) -> bool:
        t = self.toxics
        limit = t.reset_peer if t.reset_peer is not None else t.limit_data
        if limit is None or sent + len(data) <= limit:
            return False
        self.toxic_hits += 1
        dst.write(data[: max(0, limit - sent)])
        await dst.drain()
        if t.reset_peer is not None:
            sock = dst.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            dst.transport.abort()
        else:
            dst.close()
        return True
