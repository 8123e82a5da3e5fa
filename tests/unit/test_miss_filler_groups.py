"""MissFiller: a fetch group settles only its own waiters, even when the same expert is fetched
again by a newer group while the first one is still busy with its other experts (an expert
served, evicted under a tight budget and asked for again; the soak found it)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any, NamedTuple

import xxhash

from cachecd.daemon.misses import MissFiller
from cachecd.store.store import Store


class Expert(NamedTuple):
    layer: int
    expert: int
    digest_hex: str
    nbytes: int
    data: bytes
    source: str = ""  # its source key (manifest.provenance): one fake source for all


def _expert(i: int) -> Expert:
    data = random.Random(i).randbytes(3000)
    return Expert(1, i, xxhash.xxh3_128(data).hexdigest(), len(data), data)


class GatedUpstream:
    """Hands each expert over once its gate opens (buffered: no spool)."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}

    async def fetch_experts(self, manifest: Any, entries: list[Expert], on_verified: Any,
                            spool: Any = None, on_peer_verified: Any = None) -> dict[Any, Any]:
        async def one(e: Expert) -> None:
            await self.gates[e.digest_hex].wait()
            await on_verified(e, memoryview(e.data))

        await asyncio.gather(*(one(e) for e in entries))
        return {}


class Model:
    repo = "org/name"
    manifest = None


def test_an_old_group_does_not_fail_a_newer_fetch_of_the_same_expert(tmp_path: Path) -> None:
    async def main() -> None:
        store = await Store.open([tmp_path])
        upstream = GatedUpstream()
        filler = MissFiller(store, upstream)  # type: ignore[arg-type]
        a, b = _expert(1), _expert(2)
        upstream.gates = {a.digest_hex: asyncio.Event(), b.digest_hex: asyncio.Event()}
        upstream.gates[a.digest_hex].set()
        first = asyncio.create_task(filler.ensure(Model(), [a, b]))  # type: ignore[arg-type]
        while not store.has(a.digest_hex):  # a is in, b still downloading
            await asyncio.sleep(0.01)
        await store.evict([a.digest_hex])
        upstream.gates[a.digest_hex] = asyncio.Event()  # the refetch of a takes a while
        second = asyncio.create_task(filler.ensure(Model(), [a]))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        upstream.gates[b.digest_hex].set()  # the first group ends
        await first
        await asyncio.sleep(0.05)
        assert not second.done(), second  # still waiting for its own fetch, not failed by another
        upstream.gates[a.digest_hex].set()
        await second
        assert store.has(a.digest_hex) and store.has(b.digest_hex)
        await store.close()

    asyncio.run(main())


def test_fetching_counts_the_experts_under_way_until_each_is_served(tmp_path: Path) -> None:
    async def main() -> None:
        store = await Store.open([tmp_path])
        upstream = GatedUpstream()
        filler = MissFiller(store, upstream)  # type: ignore[arg-type]
        a, b = _expert(1), _expert(2)
        upstream.gates = {a.digest_hex: asyncio.Event(), b.digest_hex: asyncio.Event()}
        both = asyncio.create_task(filler.fill(Model(), [a, b]))  # type: ignore[arg-type, list-item]
        await asyncio.sleep(0)
        assert filler.fetching() == {"experts": 2, "bytes": 6000, "fetched_experts": 0,
                                     "fetched_bytes": 0}
        upstream.gates[a.digest_hex].set()
        while filler.fetching()["experts"] == 2:
            await asyncio.sleep(0.01)
        assert filler.fetching() == {"experts": 1, "bytes": 3000, "fetched_experts": 1,
                                     "fetched_bytes": 3000}
        upstream.gates[b.digest_hex].set()
        await both
        assert filler.fetching()["experts"] == 0 and filler.fetching()["fetched_experts"] == 2
        await filler.settled()
        await store.close()

    asyncio.run(main())
