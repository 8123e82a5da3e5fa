"""Peers (``cachecd serve --peer URL``): other daemons' ``--share``, asked for experts by content
before the source is asked for their ranges.

Peers are not an ``ExpertSource``: a source answers byte ranges of files at a commit, a peer
answers blobs by digest, and only for the experts it happens to hold. So they are a tier in front
of the source inside ``fetch.Upstream``: the experts a peer served and that verified are handed
over; the rest go to the source as if there were no peers.

Invariants:
- A peer's bytes pass the same check as the source's (``verify.verify_async`` against the
  manifest's xxh3-128 and size) before anything is handed over; a wrong expert is dropped and
  fetched from the source.
- One peer costs at most ``deadline_s`` per batch, down, slow or refusing; then it is left for
  the source. Peers are asked in the order named, each for what the ones before did not have.
- A peer that answered wrong bytes is not asked again for ``skip_s`` (``lies`` counts them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import aiohttp

from cachecd import constants, errors
from cachecd.upstream.hub_plan import EntryLike
from cachecd.upstream.verify import verify_async

log = logging.getLogger(__name__)

SIZES_HEADER = "X-Cachecd-Sizes"
ExpertKey = tuple[int, int]


class Peers:
    """The named peers, asked in order; ``stats`` feed status and ``/metrics``."""

    def __init__(self, urls: Sequence[str], token: str, *,
                 deadline_s: float = constants.PEER_DEADLINE_S,
                 skip_s: float = constants.PEER_SKIP_S,
                 max_experts: int = constants.SHARE_MAX_EXPERTS_PER_REQUEST) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self._auth = {"Authorization": f"Bearer {token}"}
        self.deadline_s, self.skip_s, self.max_experts = deadline_s, skip_s, max_experts
        self.skipped_until: dict[str, float] = {}
        self.counters: Counter[str] = Counter()
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_settings(cls, settings: Any, token: str) -> Peers:
        return cls(settings.peers, token, deadline_s=settings.peer_deadline)

    def stats(self) -> dict[str, int]:
        now = time.monotonic()
        return {**self.counters,
                "skipped": sum(1 for t in self.skipped_until.values() if t > now)}

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"url": u, "skipped_for_s": round(max(0.0, self.skipped_until.get(u, 0) - now), 1)}
                for u in self.urls]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, entries: Sequence[EntryLike]) -> dict[ExpertKey, memoryview]:
        """The verified bytes of those ``entries`` some peer had, by (layer, expert)."""
        got: dict[ExpertKey, memoryview] = {}
        for url in self.urls:
            want = [e for e in entries if (e.layer, e.expert) not in got]
            if not want:
                break
            if self.skipped_until.get(url, 0) > time.monotonic():
                continue
            for i in range(0, len(want), self.max_experts):
                batch = want[i:i + self.max_experts]
                try:
                    async with asyncio.timeout(self.deadline_s):
                        body, sizes = await self._ask(url, batch)
                except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                    self.counters[f"faults_{_kind(exc)}"] += 1
                    log.info("peer unavailable url=%s err=%r", url, exc)
                    break
                if not await self._take(url, batch, body, sizes, got):
                    break
        return got

    async def _ask(self, url: str, batch: Sequence[EntryLike]) -> tuple[bytearray, list[int]]:
        if self._session is None:
            self._session = aiohttp.ClientSession(trust_env=False)
        self.counters["requests"] += 1
        digests = [e.xxh3.hex() for e in batch]
        async with self._session.post(f"{url}/v1/blobs", data=json.dumps(digests),
                                      headers=self._auth) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                  message=resp.reason or "")
            sizes = [int(s) for s in resp.headers.get(SIZES_HEADER, "").split(",")]
            if len(sizes) != len(batch) or any(s < 0 for s in sizes):
                raise ValueError(f"sizes {sizes[:4]}... for {len(batch)} experts asked")
            # Into one buffer of the announced size as chunks arrive: no join at the end.
            body, pos = bytearray(sum(sizes)), 0
            async for chunk in resp.content.iter_any():
                if pos + len(chunk) > len(body):
                    raise ValueError(f"more than the {len(body)} bytes announced")
                body[pos:pos + len(chunk)] = chunk
                pos += len(chunk)
        if pos != len(body):
            raise ValueError(f"{pos} bytes of the {len(body)} announced")
        return body, sizes

    async def _take(self, url: str, batch: Sequence[EntryLike], body: bytearray, sizes: list[int],
                    got: dict[ExpertKey, memoryview]) -> bool:
        """Verify each expert the peer sent; False (and the peer skipped) if one was wrong."""
        view, pos = memoryview(body), 0
        for entry, size in zip(batch, sizes, strict=True):
            part, pos = view[pos:pos + size], pos + size
            if not size:
                self.counters["misses"] += 1
                continue
            try:
                await verify_async(entry, part)
            except errors.ChecksumMismatch as exc:
                self.counters["lies"] += 1
                self.skipped_until[url] = time.monotonic() + self.skip_s
                log.warning("peer served wrong bytes url=%s skipped_for_s=%.0f err=%s",
                            url, self.skip_s, exc.message)
                return False
            got[(entry.layer, entry.expert)] = part
            self.counters["experts"] += 1
            self.counters["bytes"] += size
        return True


def _kind(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientResponseError):
        return "refused"
    if isinstance(exc, ValueError):
        return "bad_answer"
    return "connect"
