"""``serve --share``'s bounds: past its requests or bytes in flight a request is answered 503 with
Retry-After (counted by reason), never queued; the token is checked before either."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from cachecd.daemon.share import Sharing


class _Daemon:
    """A daemon with one 1000-byte blob, already verified."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.store = self  # the blob was verified as every source asked

    def has_source(self, digest: str, source: str) -> bool:
        return True

    async def open_verified_blob(self, digest: str) -> tuple[int, int]:
        import os

        return os.dup(self.fd), 1000


def _ask(sharing: Sharing, token: str = "t") -> tuple[int, dict[str, Any]]:
    async def go() -> tuple[int, dict[str, Any]]:
        async with TestClient(TestServer(sharing.app())) as client:
            resp = await client.get("/v2/blob/" + "a" * 32 + "/" + "b" * 32,
                                    headers={"Authorization": f"Bearer {token}"})
            await resp.read()
            return resp.status, dict(resp.headers)

    return asyncio.run(go())


def test_past_the_request_bound_it_answers_503_with_retry_after(tmp_path):
    sharing = Sharing(None, "t", max_requests=0)
    status, headers = _ask(sharing)
    assert status == 503 and headers["Retry-After"] == "1"
    assert sharing.counters["refused_busy"] == 1
    assert _ask(sharing, token="x")[0] == 401  # the token first, whatever the load


def test_past_the_byte_bound_it_answers_503_and_closes_what_it_opened(tmp_path):
    import os

    blob = tmp_path / "blob"
    blob.write_bytes(b"x" * 1000)
    fd = os.open(blob, os.O_RDONLY)
    sharing = Sharing(_Daemon(fd), "t", max_bytes=500)
    assert _ask(sharing)[0] == 200  # one blob bigger than the bound still goes when alone
    sharing.bytes_in_flight = 1
    assert _ask(sharing)[0] == 503
    assert sharing.counters["refused_busy"] == 1 and sharing.counters["served_experts"] == 1
    os.close(fd)
