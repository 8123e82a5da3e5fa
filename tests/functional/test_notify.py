"""`cachecd serve` under a `Type=notify` systemd unit: the readiness messages a real daemon sends
to the datagram socket systemd would pass in NOTIFY_SOCKET, read here from a socket of our own."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid

import pytest

from cachecd.errors import DaemonUnavailable
from tests.harness import DaemonProcess, short_tmp


def _messages(sock: socket.socket, until: str, timeout: float = 60) -> list[list[str]]:
    """Datagrams received until one holds the line ``until``, each split into its lines."""
    sock.settimeout(timeout)
    got = []
    while not got or until not in got[-1]:
        got.append(sock.recv(4096).decode().split("\n"))
    return got


def _answers(d: DaemonProcess) -> bool:
    try:
        with d.client(timeout=5) as c:
            return bool(c.health()["ok"])
    except DaemonUnavailable:
        return False


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_ready_comes_after_recovery_once_the_socket_answers(hub, tiny_manifest_path, abstract):
    base = short_tmp("cdn")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"cachecd-test-{uuid.uuid4().hex}"
        listener.bind("\0" + name)
        address = "@" + name
    else:
        address = str(base / "notify")
        listener.bind(address)
    # Recovery held for a while: the daemon must not call itself ready meanwhile.
    env = {"NOTIFY_SOCKET": address, "CACHECD_PAUSE_AT": "during_recovery:1.5"}
    d = DaemonProcess(hub.url, [tiny_manifest_path], env=env)
    try:
        with open(d.log_path, "ab") as log:
            d.proc = subprocess.Popen(d.argv, stdout=log, stderr=log, env=d.env)
        recovering = f"STATUS=recovering the cache: {d.cache_dir}"
        assert _messages(listener, until=recovering) == [[recovering]]
        assert not _answers(d)  # recovering: nothing listens yet, and no READY was sent
        rest = _messages(listener, until="READY=1")
        assert _answers(d)  # at once, no retry: READY=1 comes only once the socket accepts
        assert "event=recovery " in d.log()  # and after recovery reported its work
        assert rest == [["STATUS=registering models"],
                        ["READY=1", f"STATUS=serving on {d.socket}"]]
        assert d.stop() == 0
        stopping = _messages(listener, until="STOPPING=1", timeout=5)
        assert stopping[-1][0] == "STOPPING=1"
    finally:
        listener.close()
        d.cleanup()
        shutil.rmtree(base, ignore_errors=True)
        if not abstract and os.path.exists(address):
            os.unlink(address)
