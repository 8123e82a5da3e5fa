"""The client closes every file descriptor that came with an answer it cannot use.

A real Unix-socket server on the data socket's path answers each request with 12 fds (SCM_RIGHTS)
and a malformed frame; the client's ``experts`` must raise, and this process must hold as many
fds afterwards as before (counted in /proc/self/fd).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachecd import protocol
from cachecd.config import data_socket_path
from cachecd.errors import CachecdError
from cachecd_client import Client

FDS = 12
BAD = {
    "not JSON": struct.pack(">I", 5) + b"{oops",
    "not an object": struct.pack(">I", 2) + b"[]",
    "over the frame limit": struct.pack(">I", protocol.MAX_FRAME + 1),
    "closed mid-frame": struct.pack(">I", 100) + b'{"ok": tr',
}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def bad_daemon(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, threading.Semaphore, list[int]]]:
    """A data socket whose every answer is ``request.param``'s bytes with 12 fds attached, and a
    semaphore released once the server has closed its own copies of an answer's fds."""
    control = tmp_path / "cachecd.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(data_socket_path(control)))
    server.listen(8)
    answer: bytes = request.param
    sent: list[int] = []
    closed = threading.Semaphore(0)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(65536)
                    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(FDS)]
                    socket.send_fds(conn, [answer], fds)
                    for fd in fds:
                        os.close(fd)
                    sent.append(len(fds))
                    closed.release()
                except OSError:
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield control, closed, sent
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    t.join(timeout=10)
    assert sent, "the server never answered: the test did not reach the client's receive"


@pytest.mark.parametrize("bad_daemon", list(BAD.values()), ids=list(BAD), indirect=True)
def test_malformed_answer_closes_every_received_fd(
        bad_daemon: tuple[Path, threading.Semaphore, list[int]]) -> None:
    control, closed, sent = bad_daemon
    with Client(control, timeout=30) as client:
        before = _open_fds()
        for _ in range(3):
            with pytest.raises((CachecdError, OSError)):
                client.experts("org/model", 1, list(range(FDS)))
        # The server's own copies are closed on its thread, maybe after the client raised:
        # count only once every answer's are.
        for _ in range(len(sent)):
            assert closed.acquire(timeout=30), "the server never closed its copies"
        after = _open_fds()
    assert after == before, f"{after - before} fds leaked by 3 malformed answers of {FDS} fds"
