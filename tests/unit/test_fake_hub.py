"""FakeHub itself: the HF resolve contract, Range, knobs, records; in a thread and as a subprocess.
Other tests trust its counts and timestamps, so they are checked here with a plain HTTP client."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from tests.fakes.fake_hub import DEFAULT_REPO, DEFAULT_REVISION, FakeHub, FakeHubThread

RESOLVE = f"/{DEFAULT_REPO}/resolve/{DEFAULT_REVISION}/w.bin"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fake")
    (d / "w.bin").write_bytes(os.urandom(300_000))
    return d


async def get(
    s: aiohttp.ClientSession, url: str, rng: str | None = None
) -> tuple[int, bytes, dict[str, str]]:
    headers = {"Range": rng} if rng else {}
    async with s.get(url, headers=headers, allow_redirects=False) as r:
        body = await r.read()
        return r.status, body, r.headers.copy()  # type: ignore[return-value]


def test_resolve_head_redirects_to_a_signed_cdn_url(folder: Path) -> None:
    data = (folder / "w.bin").read_bytes()

    async def main() -> None:
        async with FakeHub(folder) as hub, aiohttp.ClientSession() as s:
            async with s.head(hub.url + RESOLVE, allow_redirects=False) as r:
                assert r.status == 302
                assert r.headers["X-Repo-Commit"] == DEFAULT_REVISION
                assert r.headers["X-Linked-Size"] == str(len(data))
                assert r.headers["X-Linked-Etag"] == f'"{hashlib.sha256(data).hexdigest()}"'
                loc = r.headers["Location"]
            assert loc.startswith(hub.url + "/cdn/") and "sig=" in loc
            status, body, h = await get(s, loc, "bytes=10-19")
            assert (status, body, h["Content-Range"]) == (
                206,
                data[10:20],
                f"bytes 10-19/{len(data)}",
            )
            status, body, _ = await get(s, loc)
            assert (status, body) == (200, data)
            assert (await get(s, loc + "x", "bytes=0-1"))[0] == 403  # signature checked
            hub.invalidate_urls()
            assert (await get(s, loc, "bytes=0-1"))[0] == 403
            missing = hub.url + RESOLVE.replace("w.bin", "nope.bin")
            assert (await get(s, missing))[0] == 404
            assert [r.kind for r in hub.records][:2] == ["resolve_head", "cdn_get"]

    asyncio.run(main())


def test_knobs_shape_the_answer(folder: Path) -> None:
    data = (folder / "w.bin").read_bytes()

    async def main() -> None:
        async with FakeHub(folder) as hub, aiohttp.ClientSession() as s:
            async with s.head(hub.url + RESOLVE, allow_redirects=False) as r:
                loc = r.headers["Location"]
            f = hub.faults
            f.flip_byte, f.times = True, 1
            status, body, _ = await get(s, loc, "bytes=0-99")
            assert status == 206 and body != data[:100] and len(body) == 100
            assert sum(a != b for a, b in zip(body, data[:100], strict=True)) == 1
            assert (await get(s, loc, "bytes=0-99"))[1] == data[:100]  # times=1 used up
            f.times = None
            f.flip_byte = False
            f.wrong_content_range = True
            assert (await get(s, loc, "bytes=0-99"))[2]["Content-Range"] == "bytes 1-100/300000"
            f.wrong_content_range, f.ignore_range = False, True
            assert (await get(s, loc, "bytes=0-99"))[:2] == (200, data)
            f.ignore_range = False
            f.status_script, f.retry_after = [429, 0], "2"
            status, _, h = await get(s, loc, "bytes=0-9")
            assert status == 429 and h["Retry-After"] == "2" and h["X-Request-Id"]
            assert (await get(s, loc, "bytes=0-9"))[0] == 206
            f.truncate_after = 1000
            with pytest.raises(aiohttp.ClientPayloadError):
                await get(s, loc, "bytes=0-99999")

    asyncio.run(main())


def test_counts_peak_in_flight_and_arrival_times(folder: Path) -> None:
    async def main() -> None:
        async with FakeHub(folder) as hub, aiohttp.ClientSession() as s:
            async with s.head(hub.url + RESOLVE, allow_redirects=False) as r:
                loc = r.headers["Location"]
            hub.faults.delay = 0.2
            await asyncio.gather(*(get(s, loc, "bytes=0-9") for _ in range(5)))
            assert hub.count("cdn_get") == 5 and hub.peak_in_flight == 5
            t = hub.times("cdn_get")
            assert max(t) - min(t) < 0.2  # stamped at arrival, not after the delay

    asyncio.run(main())


def test_thread_and_subprocess_forms(folder: Path) -> None:
    with FakeHubThread(folder) as hub:
        with urllib.request.urlopen(hub.url + RESOLVE) as r:  # follows the 302
            assert r.read() == (folder / "w.bin").read_bytes()
        assert hub.count("resolve_get") == 1 and hub.count("cdn_get") == 1

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.fake_hub", str(folder)],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + RESOLVE) as r:
            assert len(r.read()) == 300_000
    finally:
        proc.terminate()
        proc.wait(timeout=10)
