"""The client closes every file descriptor that came with an answer it cannot use.

A real Unix-socket server (another process) on the data socket's path answers each request with 12 fds (SCM_RIGHTS)
and a malformed frame; the client's ``experts`` must raise, and this process must hold as many
fds afterwards as before (counted in /proc/self/fd).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
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


_SERVER = """
import os, socket, sys
path, answer, fds_each, log = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen(8)
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    with conn:
        try:
            conn.recv(65536)
            fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(fds_each)]
            socket.send_fds(conn, [answer], fds)
            for fd in fds:
                os.close(fd)
            with open(log, "a") as f:
                f.write("sent\\n")
        except OSError:
            pass
"""


@pytest.fixture
def bad_daemon(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A data socket whose every answer is ``request.param``'s bytes with 12 fds attached,
    served by another process (so its own fds never count in this one's)."""
    control = tmp_path / "cachecd.sock"
    log = tmp_path / "sent.log"
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(data_socket_path(control)),
                             request.param.hex(), str(FDS), str(log)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield control
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert log.exists() and log.read_text().count("sent"), \
        "the server never answered: the test did not reach the client's receive"


@pytest.mark.parametrize("bad_daemon", list(BAD.values()), ids=list(BAD), indirect=True)
def test_malformed_answer_closes_every_received_fd(bad_daemon: Path) -> None:
    with Client(bad_daemon, timeout=30) as client:
        before = _open_fds()
        for _ in range(3):
            with pytest.raises((CachecdError, OSError)):
                client.experts("org/model", 1, list(range(FDS)))
        after = _open_fds()
    assert after == before, f"{after - before} fds leaked by 3 malformed answers of {FDS} fds"
