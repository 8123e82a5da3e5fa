"""Peers (``cachecd serve --peer URL``): other daemons' ``--share``, asked for experts by content
and source (digest + source key, ``manifest.provenance``; protocol v2, docs/sharing.md) before the
source is asked for their ranges.

Peers are not an ``ExpertSource``: a source answers byte ranges of files at a commit, a peer
answers blobs by digest, and only for the experts it happens to hold. So they are a tier in front
of the source inside ``fetch.Upstream``: the experts a peer served and that verified are handed
over; the rest go to the source as if there were no peers.

Invariants:
- A peer's bytes pass the same check as the source's (xxh3-128 and size against the manifest,
  ``verify.verify_digest`` over the streamed bytes) before anything is handed over; a wrong
  expert is dropped and fetched from the source. A peer is asked for an expert's digest AS its
  source key, and serves it only if it verified that blob as those shard bytes: its answer is
  its word for the provenance (the caller records it as the peer's, ``store.sources``).
- What is asked of a peer is split into requests (``batches``) run ``max_parallel`` at a time
  per peer, across every fetch of this process; each request's body is streamed into the
  spool's blob writers as it arrives (``hub_stream.Stream``: hashed on the way, never held
  whole). A writer not handed over (a fault, wrong bytes, a failed write, a cancel) is discarded
  before ``fetch`` returns: no temp file outlives it.
- ``deadline_s`` bounds connecting, the first byte of the answer and any stall of the body (no
  byte for that long), not the whole transfer: a peer that is down, refuses or stalls costs at
  most about the deadline, a slow one that keeps sending is waited for (up to the Hub's total
  timeout). After a fault a peer gets no further request in this fetch; peers are asked in the
  order named, each for what the ones before did not have.
- A request's whole time is bounded too, by its bytes at ``min_rate`` plus the deadline
  (``_paced``): a peer that trickles bytes just inside the stall deadline is cut there.
- A peer that answered wrong bytes, or was cut for sending too slowly, is not asked again for
  ``skip_s`` (``lies``, ``slow`` count them); ``describe`` says why. One whose request failed
  (it could not be reached, timed out, refused) is down in ``describe`` from that fault until a
  request of it is answered again, and is not asked for ``down_skip``: ``down_skip_s`` after
  the first fault, doubled at each fault in a row up to ``down_skip_max_s``; while skipped its
  misses go to the source at once. Requests in flight together that fail together are one
  fault (the first sets the skip, the others find it set). An answer ends the streak. A share
  that answers busy (503, ``Retry-After: 1``) is up: its misses go to the source, not skipped.
- A peer's redirect is never followed (a 3xx is a refusal): the bytes come from the URL named.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import aiohttp

from cachecd import constants, errors
from cachecd.secrets import Secret, reveal
from cachecd.upstream.hub_client import READ_BUFSIZE
from cachecd.upstream.hub_plan import EntryLike
from cachecd.upstream.hub_stream import Stream
from cachecd.upstream.verify import verify_digest

log = logging.getLogger(__name__)

SIZES_HEADER = "X-Cachecd-Sizes"
ExpertKey = tuple[int, int]
# Called once per verified expert with the spool's writer (or, without a spool, the bytes).
Hand = Callable[[Any, Any], Awaitable[None]]
# One request's experts at most this many bytes: ``max_parallel`` of them stay under what a share
# sends at once (SHARE_MAX_BYTES_IN_FLIGHT), so the share does not answer busy.
REQUEST_MAX_BYTES = constants.SHARE_MAX_BYTES_IN_FLIGHT // constants.SHARE_MAX_REQUESTS


class _Fault(Exception):
    """This peer is done for this fetch (already counted and logged)."""


class Peers:
    """The named peers, asked in order; ``stats`` feed status and ``/metrics``."""

    def __init__(self, urls: Sequence[str], token: Secret | str, *,
                 deadline_s: float = constants.PEER_DEADLINE_S,
                 skip_s: float = constants.PEER_SKIP_S,
                 down_skip_s: float = constants.PEER_DOWN_SKIP_S,
                 down_skip_max_s: float = constants.PEER_DOWN_SKIP_MAX_S,
                 min_rate: int = constants.PEER_MIN_RATE,
                 max_experts: int = constants.SHARE_MAX_EXPERTS_PER_REQUEST,
                 max_parallel: int = constants.MAX_PARALLEL_FETCHES,
                 target_bytes: int = constants.COALESCE_TARGET_BYTES) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self._auth = {"Authorization": f"Bearer {reveal(token)}"}
        self.deadline_s, self.skip_s, self.max_experts = deadline_s, skip_s, max_experts
        self.max_parallel = max(1, min(max_parallel, constants.SHARE_MAX_REQUESTS))
        self.target_bytes = target_bytes
        self.min_rate = min_rate
        self.down_skip_s, self.down_skip_max_s = down_skip_s, down_skip_max_s
        self.skipped_until: dict[str, float] = {}
        self.skipped_why: dict[str, str] = {}
        self.down: dict[str, tuple[str, float]] = {}  # url -> (why, since: monotonic)
        self.faults_in_a_row: dict[str, int] = {}  # url -> faults since it last answered
        self._asking: dict[str, dict[object, float]] = {}  # url -> requests under way: start
        self.counters: Counter[str] = Counter()
        self._session: aiohttp.ClientSession | None = None
        self._gates: dict[str, asyncio.Semaphore] = {}  # requests in flight per peer

    @classmethod
    def from_settings(cls, settings: Any, token: Secret | str) -> Peers:
        return cls(settings.peers, token, deadline_s=settings.peer_deadline,
                   min_rate=settings.peer_min_rate,
                   max_parallel=settings.max_parallel)

    def stats(self) -> dict[str, int]:
        now = time.monotonic()
        return {**self.counters,
                "skipped": sum(1 for t in self.skipped_until.values() if t > now),
                "in_flight": sum(len(a) for a in self._asking.values())}

    def describe(self) -> list[dict[str, Any]]:
        """Each peer: how long it is skipped for and why, its requests under way and the oldest
        one's age (what a waiting client is told)."""
        now = time.monotonic()
        out = []
        for u in self.urls:
            asking = self._asking.get(u, {})
            out.append({"url": u,
                        "skipped_for_s": round(max(0.0, self.skipped_until.get(u, 0) - now), 1),
                        "skipped_because": self.skipped_why.get(u, ""),
                        **self._down(u, now),
                        "in_flight": len(asking),
                        "waiting_s": round(now - min(asking.values()), 1) if asking else 0.0})
        return out

    def _down(self, url: str, now: float) -> dict[str, Any]:
        if url not in self.down:
            return {}
        why, since = self.down[url]
        return {"down_because": why, "down_for_s": round(now - since, 1),
                "down_faults_in_a_row": self.faults_in_a_row.get(url, 0)}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, entries: Sequence[EntryLike], hand: Hand, spool: Any,
                    pool: Executor) -> set[ExpertKey]:
        """Hand over (``hand(entry, writer)``) each of ``entries`` some peer had and that
        verified, as it does; return their (layer, expert). ``spool`` is ``fetch.Spool`` (None:
        the bytes are gathered in memory and handed over as a memoryview)."""
        done: set[ExpertKey] = set()
        spool = _Buffers() if spool is None else spool
        entries = list({_ident(e): e for e in entries}.values())  # a spool: one writer each
        for url in self.urls:
            want = [e for e in entries if (e.layer, e.expert) not in done]
            if not want:
                break
            if self._skipped(url):
                continue
            await self._from(url, want, hand, spool, pool, done)
        return done

    def _skipped(self, url: str) -> bool:
        return self.skipped_until.get(url, 0) > time.monotonic()

    async def _from(self, url: str, want: list[EntryLike], hand: Hand, spool: Any,
                    pool: Executor, done: set[ExpertKey]) -> None:
        gate = self._gates.setdefault(url, asyncio.Semaphore(self.max_parallel))
        faulted = False

        async def one(batch: list[EntryLike]) -> None:
            nonlocal faulted
            async with gate:
                if faulted or self._skipped(url):
                    return  # left for the source
                try:
                    await self._paced(url, batch, hand, spool, pool, done)
                except _Fault:
                    faulted = True
                except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                    if not faulted:  # the requests in flight with it mostly fail the same way
                        self._fault(url, exc)
                    faulted = True

        reqs = batches(want, parallel=self.max_parallel, max_experts=self.max_experts,
                       target_bytes=self.target_bytes, max_bytes=REQUEST_MAX_BYTES)
        async with asyncio.TaskGroup() as tg:
            for batch in reqs:
                tg.create_task(one(batch))

    async def _paced(self, url: str, batch: list[EntryLike], hand: Hand, spool: Any,
                     pool: Executor, done: set[ExpertKey]) -> None:
        """``_ask`` within the deadline plus the batch's bytes at ``min_rate``; past that the
        peer is skipped for a while, as a liar is."""
        nbytes = sum(e.nbytes for e in batch)
        allowed = self.deadline_s + nbytes / self.min_rate
        key, started = object(), time.monotonic()
        self._asking.setdefault(url, {})[key] = started
        try:
            async with asyncio.timeout(allowed) as bound:
                await self._ask(url, batch, hand, spool, pool, done)
        except TimeoutError:
            if not bound.expired():
                raise  # the stall deadline: a timeout, the peer is down for a while
            self._slow(url, nbytes, time.monotonic() - started, allowed)
            raise _Fault() from None
        finally:
            self._asking[url].pop(key, None)

    async def _ask(self, url: str, batch: list[EntryLike], hand: Hand, spool: Any,
                   pool: Executor, done: set[ExpertKey]) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(trust_env=False, read_bufsize=READ_BUFSIZE)
        self.counters["requests"] += 1
        timeout = aiohttp.ClientTimeout(total=constants.TOTAL_TIMEOUT_S,
                                        sock_connect=self.deadline_s, sock_read=self.deadline_s)
        async with self._session.post(f"{url}/v2/blobs", data=_body(batch),
                                      headers=self._auth, timeout=timeout,
                                      allow_redirects=False) as resp:  # never elsewhere
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                  message=resp.reason or "")
            self._answers(url)
            pieces = self._pieces(url, batch, resp.headers.get(SIZES_HEADER, ""))
            stream = Stream(0, pieces, spool, pool)
            try:
                await _read_into(resp, stream, pieces[-1][3] if pieces else 0)
                await self._take(url, stream, hand, spool, done)
            finally:
                await stream.settle()
                for part in stream.parts:
                    spool.discard(part.entry)  # not handed over: the temp goes

    def _pieces(self, url: str, batch: list[EntryLike],
                header: str) -> list[tuple[int, Any, int, int]]:
        """(index, entry, start, end) in the body of each expert the peer has."""
        sizes = [int(s) for s in header.split(",")]
        if len(sizes) != len(batch) or any(s < 0 for s in sizes):
            raise ValueError(f"sizes {sizes[:4]}... for {len(batch)} experts asked")
        pieces, pos = [], 0
        for i, (entry, size) in enumerate(zip(batch, sizes, strict=True)):
            if size and size != entry.nbytes:
                self._lied(url, f"expert layer={entry.layer} expert={entry.expert}: announced "
                                f"{size} bytes, manifest says {entry.nbytes}")
                raise _Fault()
            if size:
                pieces.append((i, entry, pos, pos + size))
                pos += size
            else:
                self.counters["misses"] += 1
        return pieces

    async def _take(self, url: str, stream: Stream, hand: Hand, spool: Any,
                    done: set[ExpertKey]) -> None:
        """Hand over each expert of a complete body that verified; a wrong one skips the peer."""
        await stream.settle()
        lie: errors.ChecksumMismatch | None = None
        for part in stream.parts:
            entry = part.entry
            if part.failed or part.writer is None:
                continue  # a write failed: the source serves it
            try:
                verify_digest(entry, part.end - part.start, stream.digest(part))
            except errors.ChecksumMismatch as exc:
                lie = lie or exc
                continue
            got = spool.take(entry)
            if got is None:
                continue
            self.counters["experts"] += 1
            self.counters["bytes"] += entry.nbytes
            done.add((entry.layer, entry.expert))
            await hand(entry, got)
        if lie is not None:
            self._lied(url, lie.message)
            raise _Fault()

    def _fault(self, url: str, exc: BaseException) -> None:
        """A request could not reach ``url`` or got no answer: it is down, and skipped for
        ``down_skip`` of its faults in a row (unless a fault of a request in flight with this
        one already skipped it: the same outage)."""
        self.counters[f"faults_{_kind(exc)}"] += 1
        if isinstance(exc, aiohttp.ClientResponseError) and exc.status == 503:
            self._answers(url)  # busy: up (it answered), asked again at the next miss
            log.info("peer busy url=%s err=%s", url, _why(exc))
            return
        now, why = time.monotonic(), _why(exc)
        self.down[url] = (why, self.down.get(url, ("", now))[1])
        if self._skipped(url):
            log.info("peer unavailable url=%s err=%s", url, why)
            return
        n = self.faults_in_a_row[url] = self.faults_in_a_row.get(url, 0) + 1
        skip = down_skip(n, self.down_skip_s, self.down_skip_max_s)
        self.skipped_until[url] = now + skip
        self.skipped_why[url] = f"down: {why}"
        log.warning("peer unavailable url=%s err=%s faults_in_a_row=%d skipped_for_s=%.0f "
                    "(the source serves its misses meanwhile)", url, why, n, skip)

    def _answers(self, url: str) -> None:
        """``url`` answered: not down, its streak of faults over, and a skip for being down
        (a request in flight with the fault's) lifted."""
        self.down.pop(url, None)
        if self.faults_in_a_row.pop(url, None) and self.skipped_why.get(url, "").startswith(
                "down: "):
            self.skipped_until.pop(url, None)
            self.skipped_why.pop(url, None)

    def _slow(self, url: str, nbytes: int, took: float, allowed: float) -> None:
        self.counters["slow"] += 1
        self.skipped_until[url] = time.monotonic() + self.skip_s
        self.skipped_why[url] = (f"it sent slower than {self.min_rate / (1 << 20):g} MiB/s "
                                 f"(--peer-min-rate)")
        log.warning("peer too slow url=%s bytes=%d took_s=%.1f allowed_s=%.1f min_rate=%d "
                    "skipped_for_s=%.0f", url, nbytes, took, allowed, self.min_rate, self.skip_s)

    def _lied(self, url: str, message: str) -> None:
        self.counters["lies"] += 1
        self.skipped_until[url] = time.monotonic() + self.skip_s
        self.skipped_why[url] = "it served wrong bytes"
        log.warning("peer served wrong bytes url=%s skipped_for_s=%.0f err=%s",
                    url, self.skip_s, message)


async def _read_into(resp: aiohttp.ClientResponse, stream: Stream, length: int) -> None:
    pos = 0
    async for chunk in resp.content.iter_any():
        if pos + len(chunk) > length:
            raise ValueError(f"more than the {length} bytes announced")
        stream.feed(chunk, pos)
        pos += len(chunk)
    if pos != length:
        raise ValueError(f"{pos} bytes of the {length} announced")


def down_skip(faults: int, first_s: float, most_s: float) -> float:
    """How long a peer down ``faults`` times in a row is skipped: ``first_s``, doubled at each
    fault after the first, at most ``most_s``."""
    return min(most_s, first_s * 2.0 ** min(faults - 1, 64))


def batches(entries: Sequence[EntryLike], *, parallel: int, max_experts: int, target_bytes: int,
            max_bytes: int) -> list[list[EntryLike]]:
    """``entries`` in order, split into requests of about equal bytes: one per ``target_bytes``
    up to ``parallel`` of them (small experts share a request, large ones run side by side),
    more only to keep each within ``max_experts`` and ``max_bytes`` (an expert larger than
    ``max_bytes`` goes alone)."""
    if not entries:
        return []
    total = sum(e.nbytes for e in entries)
    n = max(math.ceil(len(entries) / max_experts), math.ceil(total / max_bytes),
            min(parallel, len(entries), math.ceil(total / target_bytes)))
    out: list[list[EntryLike]] = [[]]
    acc = here = 0  # bytes so far, in all requests and in the last one
    for entry in entries:
        full = len(out[-1]) >= max_experts or here + entry.nbytes > max_bytes
        if out[-1] and (full or acc * n >= total * len(out)):
            out.append([])
            here = 0
        out[-1].append(entry)
        acc += entry.nbytes
        here += entry.nbytes
    return out


class _Buffer:
    """An expert's bytes in memory, for a fetch without a spool."""

    def __init__(self, nbytes: int) -> None:
        self.data = bytearray(nbytes)

    def writev(self, offset: int, views: list[memoryview]) -> None:
        for view in views:
            self.data[offset:offset + len(view)] = view
            offset += len(view)


class _Buffers:
    """A spool in memory: ``take`` gives the expert's bytes."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[bytes, str], _Buffer] = {}

    def begin(self, entry: EntryLike) -> _Buffer:
        self._bufs[_ident(entry)] = buf = _Buffer(entry.nbytes)
        return buf

    def discard(self, entry: EntryLike) -> None:
        self._bufs.pop(_ident(entry), None)

    def take(self, entry: EntryLike) -> memoryview | None:
        buf = self._bufs.pop(_ident(entry), None)
        return None if buf is None else memoryview(buf.data)


def _ident(entry: EntryLike) -> tuple[bytes, str]:
    """What one peer answer is: a digest as one source's bytes."""
    return entry.xxh3, getattr(entry, "source", "")


def _body(batch: list[EntryLike]) -> str:
    """A ``/v2/blobs`` request: each expert's digest and source key, in order."""
    return json.dumps([{"digest": e.xxh3.hex(), "source": getattr(e, "source", "")}
                       for e in batch])


def _why(exc: BaseException) -> str:
    """A fault as ``status`` says it."""
    if isinstance(exc, TimeoutError):
        return "no answer within its deadline (--peer-deadline)"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"it answered HTTP {exc.status} {exc.message}".rstrip()
    if isinstance(exc, ValueError):
        return "its answer was malformed"
    strerror = getattr(exc, "strerror", None)
    return f"could not connect ({strerror})" if strerror else "could not connect"


def _kind(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientResponseError):
        return "refused"
    if isinstance(exc, ValueError):
        return "bad_answer"
    return "connect"
