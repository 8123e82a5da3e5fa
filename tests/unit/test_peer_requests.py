"""What a daemon asks of a peer (``upstream.peers``): split into requests that run side by side,
never more at once per peer than ``max_parallel`` (across fetches), each body streamed into blob
writers and verified before it is handed over; wrong bytes are never handed over, their temp file
is gone, and the peer is skipped. The peer is a real ``serve --share`` app on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
from aiohttp import web
from aiohttp.test_utils import TestServer

from cachecd.daemon.app import Daemon
from cachecd.daemon.share import Sharing
from cachecd.store.blobs import BlobWriter, CacheDir
from cachecd.upstream.peers import Peers, batches, down_skip
from tests.harness import free_port

K3 = 17_547_264


@dataclass(frozen=True)
class _Entry:
    layer: int
    expert: int
    nbytes: int
    xxh3: bytes = b""
    ranges: tuple[Any, ...] = ()
    source: str = "5" * 32  # its source key: the share serves a blob only as a source it knows


def _sizes(groups: list[list[_Entry]]) -> list[int]:
    return [sum(e.nbytes for e in g) for g in groups]


def test_large_experts_go_side_by_side_small_ones_share_a_request_within_the_limits():
    limits = dict(parallel=8, max_experts=64, target_bytes=4 << 20, max_bytes=64 << 20)
    k3 = [_Entry(0, i, K3) for i in range(8)]
    assert [len(g) for g in batches(k3, **limits)] == [1] * 8
    assert len(batches([_Entry(0, i, 10_000) for i in range(4)], **limits)) == 1
    many = [_Entry(0, i, 1000) for i in range(200)]
    assert [len(g) for g in batches(many, **limits)] == [50, 50, 50, 50]  # balanced, <= 64
    big = [_Entry(0, i, K3) for i in range(40)]
    groups = batches(big, **limits)
    assert max(_sizes(groups)) <= 64 << 20 and [e for g in groups for e in g] == big
    assert batches([_Entry(0, 0, 100 << 20)], **limits) == [[_Entry(0, 0, 100 << 20)]]


class _Store:
    """Blobs in files by digest; opening one holds the request in flight a little (the share
    counts its requests then), so requests sent together overlap there."""

    def __init__(self, blobs: dict[str, Path], sharing: list[Sharing]) -> None:
        self.blobs, self.sharing, self.most = blobs, sharing, 0

    def has_source(self, digest: str, source: str) -> bool:
        return digest in self.blobs and source == "5" * 32

    def open_blob(self, digest: str) -> tuple[int, int]:
        path = self.blobs[digest]
        return os.open(path, os.O_RDONLY), path.stat().st_size

    def unverified(self, digest: str) -> bool:
        self.most = max(self.most, self.sharing[0].requests)
        return True

    def verify_open_blob(self, digest: str, fd: int) -> None:
        time.sleep(0.05)
        os.close(fd)


class _Spool:
    """Blob writers in a real cache dir, as the daemon's spool."""

    def __init__(self, cdir: CacheDir) -> None:
        self.cdir, self.writers = cdir, {}

    def begin(self, entry: _Entry) -> BlobWriter:
        self.writers[entry.xxh3] = w = BlobWriter(self.cdir, entry.xxh3.hex(), entry.nbytes)
        return w

    def discard(self, entry: _Entry) -> None:
        w = self.writers.pop(entry.xxh3, None)
        if w is not None:
            w.abort()

    def take(self, entry: _Entry) -> BlobWriter | None:
        return self.writers.pop(entry.xxh3, None)


class _Daemon:
    """The daemon's own way of opening a blob for the share, over the fake store."""

    open_verified_blob = Daemon.open_verified_blob

    def __init__(self, store: _Store) -> None:
        self.store = store


def _share(tmp_path: Path, n: int, lie: int | None = None,
           max_requests: int = 16) -> tuple[Sharing, _Store, list[_Entry], list[bytes]]:
    blobs, entries, datas = {}, [], []
    for i in range(n):
        data = os.urandom(300_000 + i)
        digest = xxhash.xxh3_128(data).digest()
        path = tmp_path / f"blob{i}"
        path.write_bytes(bytes([data[0] ^ 1]) + data[1:] if i == lie else data)
        blobs[digest.hex()] = path
        entries.append(_Entry(0, i, len(data), digest))
        datas.append(data)
    holder: list[Sharing] = []
    store = _Store(blobs, holder)
    sharing = Sharing(_Daemon(store), "t", max_requests=max_requests)
    holder.append(sharing)
    return sharing, store, entries, datas


async def _fetch(peers: Peers, entries: list[_Entry], spool: _Spool,
                 handed: dict[int, bytes]) -> set[tuple[int, int]]:
    from concurrent.futures import ThreadPoolExecutor

    async def hand(entry: _Entry, writer: BlobWriter) -> None:
        fd = writer.open_reader()
        handed[entry.expert] = os.pread(fd, entry.nbytes + 1, 0)
        os.close(fd)
        writer.abort()

    with ThreadPoolExecutor(2) as pool:
        return await peers.fetch(entries, hand, spool, pool)


def test_requests_run_side_by_side_never_more_than_max_parallel_per_peer(tmp_path):
    sharing, store, entries, datas = _share(tmp_path, 12, max_requests=2)
    spool, handed = _Spool(CacheDir(tmp_path / "cache", 0)), {}

    async def go() -> list[set[tuple[int, int]]]:
        async with TestServer(sharing.app(), host="127.0.0.1") as server:
            peers = Peers([str(server.make_url(""))], "t", max_parallel=2, target_bytes=100_000)
            try:  # two fetches at once, two requests each: the peer's gate holds them to two
                return await asyncio.gather(_fetch(peers, entries[:6], spool, handed),
                                            _fetch(peers, entries[6:], spool, handed))
            finally:
                assert peers.counters["requests"] == 4
                await peers.close()

    got = asyncio.run(go())
    assert set().union(*got) == {(0, i) for i in range(12)}
    assert handed == dict(enumerate(datas))
    assert store.most == 2 and sharing.counters["refused_busy"] == 0
    assert not list((tmp_path / "cache" / "tmp").iterdir())


def test_wrong_bytes_are_never_handed_over_their_temp_goes_and_the_peer_is_skipped(tmp_path):
    sharing, _, entries, datas = _share(tmp_path, 3, lie=1)
    spool, handed = _Spool(CacheDir(tmp_path / "cache", 0)), {}

    async def go() -> tuple[set[tuple[int, int]], set[tuple[int, int]], Peers]:
        async with TestServer(sharing.app(), host="127.0.0.1") as server:
            peers = Peers([str(server.make_url(""))], "t", max_parallel=1)
            first = await _fetch(peers, entries, spool, handed)
            again = await _fetch(peers, entries[1:2], spool, handed)
            await peers.close()
            return first, again, peers

    first, again, peers = asyncio.run(go())
    assert first == {(0, 0), (0, 2)} and handed == {0: datas[0], 2: datas[2]}
    assert again == set() and peers.counters["requests"] == 1  # skipped: not asked again
    assert peers.counters["lies"] == 1 and peers.stats()["skipped"] == 1
    assert not list((tmp_path / "cache" / "tmp").iterdir())


def test_a_down_peer_is_skipped_longer_at_each_fault_in_a_row_until_it_answers(tmp_path):
    """Refused, refused, then it answers, then refused again: skipped 5 s, 10 s, not at all, 5 s.
    The skip's end is moved to now where the test lets time pass (a state, not a sleep)."""
    sharing, _, entries, datas = _share(tmp_path, 1)
    spool, handed = _Spool(CacheDir(tmp_path / "cache", 0)), {}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    peers = Peers([url], "t", deadline_s=2.0)
    seen: list[tuple[float, str, int]] = []

    def look() -> None:
        d = peers.describe()[0]
        seen.append((d["skipped_for_s"], d["skipped_because"], d.get("down_faults_in_a_row", 0)))
        peers.skipped_until[url] = 0.0  # its skip is over

    async def go() -> None:
        for _ in range(2):
            assert await _fetch(peers, entries, spool, handed) == set()
            look()
        async with TestServer(sharing.app(), host="127.0.0.1", port=port):
            assert await _fetch(peers, entries, spool, handed) == {(0, 0)}
            look()
        assert await _fetch(peers, entries, spool, handed) == set()
        look()
        await peers.close()

    asyncio.run(go())
    assert handed == {0: datas[0]}
    assert [round(s + 0.4) for s, _, _ in seen] == [5, 10, 0, 5]  # describe rounds to 0.1 s
    assert [n for _, _, n in seen] == [1, 2, 0, 1]
    assert seen[0][1].startswith("down: could not connect") and seen[1][1] == seen[0][1]
    assert peers.counters["faults_connect"] == 3 and peers.counters["requests"] == 4


def test_down_skip_doubles_to_its_most():
    assert [down_skip(n, 5.0, 300.0) for n in (1, 2, 3, 6, 7, 100)] == [5, 10, 20, 160, 300, 300]


def test_a_busy_share_is_not_skipped(tmp_path):
    """A 503 (the share at its bounds, ``Retry-After: 1``) is an answer: asked at each miss."""
    _, _, entries, _ = _share(tmp_path, 1)
    app = web.Application()

    async def busy(request: web.Request) -> web.Response:
        return web.Response(status=503, headers={"Retry-After": "1"})

    app.router.add_post("/v2/blobs", busy)

    async def go() -> Peers:
        async with TestServer(app, host="127.0.0.1") as server:
            peers = Peers([str(server.make_url(""))], "t")
            for _ in range(2):
                assert await _fetch(peers, entries, _Spool(CacheDir(tmp_path / "c", 0)), {}) == set()
            await peers.close()
            return peers

    peers = asyncio.run(go())
    assert peers.counters["requests"] == 2 and peers.counters["faults_refused"] == 2
    assert peers.describe()[0]["skipped_for_s"] == 0 and peers.stats()["skipped"] == 0
    assert "down_because" not in peers.describe()[0]  # busy is up: status does not say DOWN
