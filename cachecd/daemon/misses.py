"""Turning misses into verified cache entries: one upstream fetch per expert, however many ask.

Invariants: an expert is fetched by at most one task at a time (callers for the same digest as
the same source, ``flight_key``, wait on the same future and all see the same bytes or the same error); the fetch runs in its own task,
so a caller that disconnects does not cancel it; bytes reach the store only after the upstream
verified them against the manifest (bytes written to a temp file while they arrive become a blob
only through ``Store.commit`` after that check, which records the source key they were verified
as: a blob is a hit only for experts with that source, ``missing``); a digest is forgotten when its fetch ends, so the next
request after a failure fetches again. Prefetch hints run below demand: at most
``prefetch_parallel`` hint groups at a time, and hints for experts already in flight are dropped.

A streamed expert is handed to the requests waiting for it as soon as its hash matched, before
its blob is durable: its temp file is opened read-only (``fresh``) and those waiters are answered
from that fd while ``Store.commit`` (fsync, rename, fsync the dir, index row) runs; the fd is
closed when the commit ends. A request arriving meanwhile waits for the commit, as for a fetch in
flight. So a miss never waits on the disk's flush, and the store's invariant (no row without a
durable blob) is unchanged: a crash in between loses the blob, never correctness, and a failed
commit only means the next request fetches the expert again. ``settled()`` waits for the commits
under way, for callers that report the store's state.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

from cachecd import constants
from cachecd.errors import CachecdError, Internal
from cachecd.store.blobs import BlobWriter
from cachecd.store.sources import ORIGIN_PEER, ORIGIN_SOURCE
from cachecd.store.store import Store
from cachecd.upstream.singleflight import SingleFlight

if TYPE_CHECKING:
    from cachecd.daemon.registry import RegisteredModel
    from cachecd.manifest.entries import ExpertEntry
    from cachecd.store.budget import Reservation
    from cachecd.upstream.fetch import Upstream
    from cachecd.upstream.hub_stream import VectorWriter

log = logging.getLogger(__name__)


def flight_key(entry: ExpertEntry) -> str:
    """What a fetch is for: a digest AS one source's bytes (``manifest.provenance``). Two experts
    a manifest gives one digest are two fetches, each verified against its own ranges."""
    return entry.digest_hex + entry.source


class _Spool:
    """The blob writers of one fetch group, by ``flight_key``: the upstream fills them as bytes arrive,
    the commit takes them (or writes the verified bytes itself when it finds none)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._writers: dict[str, BlobWriter] = {}

    def begin(self, entry: ExpertEntry) -> BlobWriter:
        self.discard(entry)
        writer = self._store.begin_blob(entry.digest_hex, entry.nbytes)
        self._writers[flight_key(entry)] = writer
        return writer

    def discard(self, entry: ExpertEntry) -> None:
        writer = self._writers.pop(flight_key(entry), None)
        if writer is not None:
            writer.abort()

    def take(self, entry: ExpertEntry) -> BlobWriter | None:
        return self._writers.pop(flight_key(entry), None)

    def close(self) -> None:
        for writer in self._writers.values():
            writer.abort()
        self._writers.clear()


class MissFiller:
    """Fills the store's misses: claims each missing expert once (``SingleFlight``), reserves its
    bytes, has the upstream fetch and verify it, hands it to the waiting requests and commits it
    (the module docstring has the rules)."""

    def __init__(self, store: Store, upstream: Upstream, *, prefetch_parallel: int = 2) -> None:
        self._store = store
        self._upstream = upstream
        # flight key -> the future of its fetch, or of its commit once handed over
        self._flights: SingleFlight[str, None] = SingleFlight()
        self._tasks: set[asyncio.Task[None]] = set()
        self._prefetch_slots = asyncio.Semaphore(prefetch_parallel)
        self._fresh: dict[str, tuple[int, int]] = {}  # flight key -> (read-only fd of its temp, size)
        self._commits: set[asyncio.Task[None]] = set()
        self._commits_started: set[asyncio.Task[None]] = set()  # past the wait for their download
        self._uses_after_commit: Counter[str] = Counter()
        self._downloading: dict[str, int] = {}  # flight key -> bytes: claimed, not served yet
        self.counters: Counter[str] = Counter()

    @property
    def inflight(self) -> int:
        return len(self._flights)

    def fetching(self) -> dict[str, int]:
        """What a waiting client's progress line reads (``GET /v1/fetches``): the experts being
        fetched now and their bytes, and those fetched since the daemon started."""
        return {"experts": len(self._downloading), "bytes": sum(self._downloading.values()),
                "fetched_experts": self.counters["fetched_experts"],
                "fetched_bytes": self.counters["fetched_bytes"]}

    def missing(self, entries: Iterable[ExpertEntry]) -> list[ExpertEntry]:
        """The entries that are not hits: a blob counts for an expert only if it was verified as
        that expert's own ranges (``Store.has_source``), whatever its digest."""
        has = self._store.has_source
        return [e for e in entries if not has(e.digest_hex, e.source)]

    def committing(self, key: str) -> bool:
        """``key``: a ``flight_key``."""
        return key in self._fresh

    def touch_after_commit(self, entry: ExpertEntry) -> bool:
        """If ``entry`` is being committed, count a use for the policy once it is in; True then."""
        if flight_key(entry) not in self._fresh:
            return False
        self._uses_after_commit[entry.digest_hex] += 1
        return True

    def take_fresh(self, entry: ExpertEntry) -> tuple[int, int] | None:
        """(fd, size) of a verified expert whose commit is under way, the fd the caller's own."""
        held = self._fresh.get(flight_key(entry))
        if held is None:
            return None
        return os.dup(held[0]), held[1]

    async def settled(self, download_wait: float = constants.SETTLE_DOWNLOAD_WAIT_S) -> None:
        """Wait for the commits of experts already handed out (the store then shows them).

        A commit still waiting for the rest of its group's download is waited for at most
        ``download_wait`` seconds: a stalled upstream must not stall ``cachecd status``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + download_wait
        while self._commits:
            queued = [t for t in self._commits if t not in self._commits_started]
            if queued and loop.time() >= deadline:
                started = list(self._commits_started)
                if started:
                    await asyncio.wait(started)
                return
            await asyncio.wait(list(self._commits), return_when=asyncio.FIRST_COMPLETED,
                               timeout=deadline - loop.time() if queued else None)

    async def ensure(self, model: RegisteredModel, entries: list[ExpertEntry]) -> None:
        """Return once every entry is in the store; raise the first typed error otherwise."""
        await self.fill(model, self.missing(entries))

    async def fill(self, model: RegisteredModel, missing: list[ExpertEntry]) -> None:
        """``ensure`` for entries the caller has just found missing (``missing``): no look-up
        again."""
        if not missing:
            return
        waits = self._claim(model, missing)
        results = await asyncio.gather(*(asyncio.shield(f) for f in waits), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    def prefetch(self, model: RegisteredModel, entries: list[ExpertEntry]) -> int:
        """Queue a background fetch of the entries not cached or in flight; returns how many."""
        wanted = [e for e in self.missing(entries) if not self._flights.in_flight(flight_key(e))]
        if wanted:
            self._spawn(self._prefetch_group(model, wanted))
        self.counters["prefetch_hints"] += 1
        return len(wanted)

    def _claim(self, model: RegisteredModel, missing: list[ExpertEntry]) -> list[asyncio.Future[None]]:
        waits, new = [], {}
        for entry in missing:
            key = flight_key(entry)
            fut = self._flights.waiting(key)
            if fut is None:
                fut = self._flights.claim([key])[key]
                new[key] = (entry, fut)
            else:
                self.counters["coalesced_waiters"] += 1
            waits.append(fut)
        for entry, _ in new.values():
            self._downloading[flight_key(entry)] = entry.nbytes
        if new:
            self._spawn(self._fetch_group(model, [e for e, _ in new.values()],
                                          {d: f for d, (_, f) in new.items()}))
        return waits

    def _spawn(self, coro: asyncio.coroutines.Coroutine[object, object, None]) -> None:  # type: ignore[name-defined]
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prefetch_group(self, model: RegisteredModel, entries: list[ExpertEntry]) -> None:
        async with self._prefetch_slots:
            still = [e for e in self.missing(entries)
                     if not self._flights.in_flight(flight_key(e))]
            if not still:
                return
            waits = self._claim(model, still)
            await asyncio.gather(*waits, return_exceptions=True)

    async def _fetch_group(self, model: RegisteredModel, entries: list[ExpertEntry],
                           own: dict[str, asyncio.Future[None]]) -> None:
        """Fetch ``entries``; ``own`` holds the futures this group settles. An expert served,
        evicted and claimed again by a newer group meanwhile has a newer future: not ours."""
        reservations = {}
        try:
            to_fetch = []
            for entry in entries:
                try:
                    reservations[flight_key(entry)] = await self._store.reserve(entry.nbytes)
                    to_fetch.append(entry)
                except CachecdError as exc:
                    self._settle(flight_key(entry), exc, own)
            if to_fetch:
                await self._fetch_reserved(model, to_fetch, reservations, own)
        except CachecdError as exc:
            for entry in entries:
                self._settle(flight_key(entry), exc, own)
        except Exception as exc:  # a bug must still release every waiter
            log.exception("fetch group failed repo=%s", model.repo)
            for entry in entries:
                self._settle(flight_key(entry), Internal(f"fetch failed: {exc!r}"), own)
        finally:
            for reservation in reservations.values():
                reservation.release()
            for entry in entries:
                self._settle(flight_key(entry), Internal("fetch ended without a result"), own)
                self._downloading.pop(flight_key(entry), None)

    async def _fetch_reserved(self, model, to_fetch, reservations, own) -> None:  # type: ignore[no-untyped-def]
        spool = _Spool(self._store)
        downloaded = asyncio.Event()
        commits: list[asyncio.Task[None]] = []

        async def commit(entry: ExpertEntry, got: memoryview | VectorWriter,
                         origin: bytes = ORIGIN_SOURCE) -> None:
            """Called once per verified expert with its bytes, or with its writer (one of this
            group's spool, this commit's to finish or abort from here: the spool no longer
            holds it). ``origin``: whether the source or a peer served them (``store.sources``)."""
            key = flight_key(entry)
            data = got if isinstance(got, memoryview) else None
            writer = None if data is not None else cast(BlobWriter, got)
            if writer is not None and self._hand_over(entry, writer):
                task = asyncio.get_running_loop().create_task(
                    self._commit_fresh(entry, origin, reservations[key], writer, downloaded))
                commits.append(task)
                self._commits.add(task)
                task.add_done_callback(self._commits.discard)
                task.add_done_callback(self._commits_started.discard)
                return
            await self._store.commit(entry.digest_hex, data, reservations[key], writer,
                                     entry.source, origin)
            self._served(entry)

        async def from_peer(entry: ExpertEntry, got: memoryview | VectorWriter) -> None:
            await commit(entry, got, ORIGIN_PEER)

        try:
            errors = await self._upstream.fetch_experts(model.manifest, to_fetch, commit, spool,
                                                        on_peer_verified=from_peer)
        finally:
            downloaded.set()
            spool.close()
            # The reservations are released when this group ends: not before its commits do.
            if commits:
                await asyncio.gather(*commits, return_exceptions=True)
        for (layer, expert), exc in errors.items():
            self.counters[f"fetch_error_{exc.code}"] += 1
            self._settle(flight_key(model.manifest.expert(layer, expert)), exc, own)

    def _hand_over(self, entry: ExpertEntry, writer: BlobWriter) -> bool:
        """Answer the waiters of a verified, streamed expert from its temp file."""
        try:
            fd = writer.open_reader()
        except OSError as exc:
            log.warning("event=fresh_open_failed digest=%s err=%s", entry.digest_hex, exc)
            return False
        key = flight_key(entry)
        self._fresh[key] = (fd, entry.nbytes)
        self._served(entry)
        # Requests from now on wait for the commit (``_commit_fresh`` settles this one).
        self._flights.claim([key])
        return True

    async def _commit_fresh(self, entry: ExpertEntry, origin: bytes, reservation: Reservation,
                            writer: BlobWriter, downloaded: asyncio.Event) -> None:
        digest, key = entry.digest_hex, flight_key(entry)
        started = False
        try:
            # fsyncs while the group still downloads slow its page-cache writes down (measured:
            # bench/README.md), so the group's commits start once its last byte is in.
            await downloaded.wait()
            started = True  # from here Store.commit finishes or aborts the writer, even if cancelled
            task = asyncio.current_task()
            if task is not None:
                self._commits_started.add(task)
            await self._store.commit(digest, None, reservation, writer, entry.source, origin)
            for _ in range(self._uses_after_commit.pop(digest, 0)):
                self._store.policy_touch(digest)
        except CachecdError as exc:
            self.counters["commit_failed"] += 1
            log.warning("event=commit_failed digest=%s err=%s", digest, exc)
        except Exception:
            self.counters["commit_failed"] += 1
            log.exception("commit failed digest=%s", digest)
        finally:
            if not started:
                writer.abort()  # cancelled before its commit began: no temp outlives the fetch
            self._uses_after_commit.pop(digest, None)
            fd, _ = self._fresh.pop(key)
            os.close(fd)
            self._settle(key, None)  # a failed commit: the waiters' open finds no blob, refetches

    def _served(self, entry: ExpertEntry) -> None:
        self.counters["fetched_experts"] += 1
        self.counters["fetched_bytes"] += entry.nbytes
        self._downloading.pop(flight_key(entry), None)
        self._settle(flight_key(entry), None)

    def _settle(self, key: str, exc: CachecdError | None,
                own: dict[str, asyncio.Future[None]] | None = None) -> None:
        """Settle the future in flight for ``key`` (a ``flight_key``; with ``own``: only if it is
        the one there)."""
        if own is None:
            self._flights.settle(key, exc)
        elif key in own:
            self._flights.settle(key, exc, own[key])

    async def drain(self, timeout: float) -> None:
        """Let fetches in flight finish (up to ``timeout``), then cancel what is left."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
