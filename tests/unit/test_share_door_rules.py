"""The share door's arithmetic and its address check, without a daemon (the door itself runs in
tests/functional/test_share_door.py against a real one)."""

from __future__ import annotations

import pytest

from cachecd.config import token_bits
from cachecd.daemon.share_door import connection_limit, exposure


@pytest.mark.parametrize(("soft", "limit", "per_address"), [
    (64, 8, 4), (256, 32, 16), (1024, 128, 64), (1 << 20, 128, 64)])
def test_the_share_holds_an_eighth_of_the_fd_limit_within_bounds(soft, limit, per_address):
    assert connection_limit(soft) == (limit, per_address)


@pytest.mark.parametrize(("host", "says"), [
    ("0.0.0.0:7390", "every interface"), ("[::]:7390", "every interface"),
    ("8.8.8.8:7390", "public address"), ("[2001:4860::8888]:7390", "public address"),
    ("10.0.7.1:7390", None), ("192.168.1.2:7390", None), ("169.254.3.4:7390", None),
    ("[fe80::1]:7390", None), ("127.0.0.1:7390", None), ("localhost:7390", None)])
def test_a_wildcard_or_public_share_address_is_named(host, says):
    said = exposure(host)
    assert (said is None) if says is None else (said is not None and says in said)


@pytest.mark.parametrize(("token", "enough"), [
    ("0" * 31, False), ("0123456789abcdef0123456789abcdef", True),  # secrets.token_hex(16)
    ("A" * 21, False), ("abcdefghijklmnopqrstuv", True),  # secrets.token_urlsafe(16): 22
    ("hunter2", False)])
def test_a_token_holds_128_bits_by_its_length_and_alphabet(token, enough):
    assert (token_bits(token) >= 128) is enough


def test_serve_raises_the_soft_fd_limit_to_the_hard_one():
    """What ``serve`` does first: a process started with launchd's soft limit (256) under a
    higher hard one ends with the hard one."""
    import resource
    import subprocess
    import sys

    def launchd_like() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 2048))

    code = ("import resource; from cachecd.daemon.share_door import raise_fd_limit; "
            "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         preexec_fn=launchd_like, timeout=60, check=True).stdout
    assert out.split() == ["2048", "2048"]


class _Handler:
    def force_close(self) -> None:
        self.closed = True


def test_a_token_holders_reconnection_outlasts_any_churn_of_strangers() -> None:
    """A door of 4 full of strangers; a peer whose address showed the token reconnects, then 100
    strangers arrive, one after another: its connection is never the one pushed out (before,
    it went after 4 arrivals unless its head had been read by then)."""
    import asyncio
    from collections import Counter
    from types import SimpleNamespace

    from cachecd.daemon.share_door import ShareDoor, _Conn

    async def run() -> tuple[int, int]:
        door = ShareDoor(Counter(), limit=4, per_address=4)

        def arrive(address: str) -> _Conn:
            conn = _Conn(_Handler(), door)  # type: ignore[arg-type]
            conn.address = address
            assert door.arrive(conn)
            return conn

        first = arrive("10.0.0.2")  # its token passed on an earlier connection, since closed
        await door.authorized(SimpleNamespace(protocol=first.handler, can_read_body=False))
        first.close()
        for i in range(4):
            arrive(f"127.0.1.{i}")
        peer = arrive("10.0.0.2")
        kept = 0
        for i in range(100):
            arrive(f"127.0.2.{i}")
            kept += peer in door._open
        door.close()
        return kept, door.counters["connections_dropped"]

    kept, dropped = asyncio.run(run())
    assert kept == 100 and dropped == 101  # each stranger newcomer pushed out another
