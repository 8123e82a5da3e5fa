"""The upstream: verified experts of a pinned revision from any source of bytes (``source``).

The verify-then-commit path, written once above every source: coalescing neighbouring experts
into range requests (``hub_plan``), streaming an expert into its blob writer as it arrives
(``hub_stream``), hashing it against the manifest and refetching bad bytes. The source only
answers ranges (``source.ExpertSource``: the Hub, a local folder). Named peers (``peers``), when
given, are asked first for whole experts by digest, their answers streamed into the same spool
and handed over the same way (a writer once its hash matched); what they do not serve, or serve
wrong, goes to the source.

Invariants:
- ``on_verified`` is called only with bytes whose xxh3-128 equals the manifest's; bad bytes are
  dropped, refetched at most ``checksum_refetches`` times, then reported as ChecksumMismatch.
- A range is accepted only when exactly the asked bytes came back (the source's rule; for the
  Hub's HTTP rules, resolves and the token see ``hub_client``).
- With a ``Spool``, an expert that is one range of its request is streamed into its blob writer
  as it arrives (hub_stream.py), never held whole in memory. Once every write succeeded and the
  hash of the written bytes matched, the writer is taken out of the spool and handed over
  (``on_verified(entry, writer)``): from then on the callee owns it (it commits or aborts it).
  Otherwise the writer is discarded (after its writes ended) and the expert is fetched again into
  memory, verified, and handed over as bytes (``on_verified(entry, view)``). So a temp file has
  one owner at a time: the spool while bytes arrive, then the callee, never both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from cachecd import constants, errors
from cachecd.upstream.hub_plan import DEFAULT_MAX_GAP, EntryLike, RangeRequest, plan_requests
from cachecd.upstream.hub_stream import Stream, VectorWriter
from cachecd.upstream.peers import Peers
from cachecd.upstream.source import ExpertSource
from cachecd.upstream.verify import verify_async, verify_digest

log = logging.getLogger(__name__)

# The verified expert: its bytes, or the spool's writer that holds exactly them (the callee's now).
OnVerified = Callable[[Any, "memoryview | VectorWriter"], Awaitable[None]]
ExpertKey = tuple[int, int]
SPILL_THREADS = 4


class Spool(Protocol):
    """Where experts' bytes go while they arrive (the store's blob writers)."""

    def begin(self, entry: Any) -> VectorWriter: ...

    def discard(self, entry: Any) -> None: ...

    def take(self, entry: Any) -> VectorWriter | None:
        """The entry's writer, out of the spool: the taker owns it from then on."""
        ...


class _Assembly:
    """The pieces of one expert as they arrive from (possibly) several requests."""

    __slots__ = ("entry", "error", "error_first", "parts", "pending", "streamed")

    def __init__(self, entry: EntryLike) -> None:
        self.entry = entry
        self.parts: list[memoryview | None] = [None] * len(entry.ranges)
        self.pending = len(entry.ranges)
        self.error: errors.CachecdError | None = None
        # Streamed into a writer: None (not streamed), "ok" (verified: the spool keeps the
        # writer), "bad" (hash differs: error_first), "failed" (a write failed).
        self.streamed: str | None = None
        self.error_first: errors.ChecksumMismatch | None = None

    def joined(self) -> memoryview:
        parts = [p for p in self.parts if p is not None]
        if len(parts) == 1:
            return parts[0]
        out = bytearray(self.entry.nbytes)
        pos = 0
        for part in parts:
            out[pos : pos + len(part)] = part
            pos += len(part)
        return memoryview(out)


async def _contained(key: ExpertKey, failures: dict[ExpertKey, errors.CachecdError],
                     work: Callable[[], Awaitable[None]]) -> None:
    """Run ``work`` (an expert's hand-over); its error becomes that expert's failure, a bug in
    ``on_verified`` (someone else's code) included, so one expert never fails the batch."""
    try:
        await work()
    except errors.CachecdError as exc:
        failures[key] = exc
    except Exception as exc:
        log.exception("on_verified failed layer=%d expert=%d", *key)
        failures[key] = errors.Internal(f"storing expert {key} failed: {type(exc).__name__}: {exc}")


class Upstream:
    """Verified experts from ``source``: the one path from a source's bytes to a commit.

    It owns the source (``close`` closes both) and passes the source's counters through
    (``stats``, ``observe_requests``). Create and close it inside the daemon's event loop.
    """

    def __init__(
        self,
        source: ExpertSource,
        *,
        coalesce_max_bytes: int = constants.COALESCE_MAX_BYTES,
        coalesce_max_experts: int = constants.COALESCE_MAX_EXPERTS,
        coalesce_max_gap: int = DEFAULT_MAX_GAP,
        coalesce_target_bytes: int = constants.COALESCE_TARGET_BYTES,
        checksum_refetches: int = constants.CHECKSUM_REFETCHES,
        peers: Peers | None = None,
    ) -> None:
        self.source = source
        self.peers = peers
        self.coalesce_max_bytes = coalesce_max_bytes
        self.coalesce_max_experts = coalesce_max_experts
        self.coalesce_max_gap = coalesce_max_gap
        self.coalesce_target_bytes = coalesce_target_bytes
        self.checksum_refetches = checksum_refetches
        self._spill_pool: ThreadPoolExecutor | None = None

    @property
    def offline(self) -> bool:
        return self.source.offline

    def stats(self) -> dict[str, int]:
        if self.peers is None:
            return self.source.stats()
        return self.source.stats() | {f"peer_{k}": v for k, v in self.peers.stats().items()}

    def observe_requests(self, observe: Callable[[str, float], None]) -> None:
        self.source.observe_requests(observe)

    async def close(self) -> None:
        await self.source.close()
        if self.peers is not None:
            await self.peers.close()
        if self._spill_pool is not None:
            self._spill_pool.shutdown(wait=False)
            self._spill_pool = None

    async def fetch_experts(
        self,
        manifest: Any,
        entries: Sequence[EntryLike],
        on_verified: OnVerified,
        spool: Spool | None = None,
        on_peer_verified: OnVerified | None = None,
    ) -> dict[ExpertKey, errors.CachecdError]:
        """Fetch, verify and hand over every entry; return the errors of those that failed.

        ``on_verified(entry, view)`` runs once per verified expert; ``view`` may point into a
        larger download buffer, so copy or write it before returning rather than keeping it.
        For a streamed expert it gets the spool's writer instead, and owns it. Experts a peer
        served go to ``on_peer_verified`` instead where given (their provenance is the peer's
        word, ``store.sources``).
        An error raised by ``on_verified`` becomes that expert's error. With ``spool``, bytes
        are written to ``spool.begin(entry)`` as they arrive; see the module invariants.
        """
        if self.offline:
            raise self.source.offline_error(f"{len(entries)} expert(s) of {manifest.key}")
        unique = list({(e.layer, e.expert): e for e in entries}.values())
        failures: dict[ExpertKey, errors.CachecdError] = {}
        if self.peers is not None and self.peers.urls:
            unique = await self._from_peers(manifest, unique, on_peer_verified or on_verified,
                                            failures, spool)
            if not unique:
                return failures
        states = [_Assembly(e) for e in unique]
        requests = plan_requests(
            unique,
            max_bytes=self.coalesce_max_bytes,
            max_experts=self.coalesce_max_experts,
            max_gap=self.coalesce_max_gap,
            parallel=self.source.max_parallel,
            target_bytes=self.coalesce_target_bytes,
        )

        streams: list[Stream] = []

        async def run(req: RangeRequest) -> None:
            stream = self._stream_for(req, states, spool)
            if stream is not None:
                streams.append(stream)
            try:
                buf: memoryview | None = memoryview(
                    await self.source.get_range(manifest, req.file, req.start, req.end, stream)
                )
            except errors.CachecdError as exc:
                buf, err = None, exc
            except Exception as exc:  # a bug must fail these experts, not the whole batch
                log.exception("upstream request failed file=%s", req.file)
                # Its type and message, never its repr: an aiohttp error's holds the request's
                # headers, the token among them (errors.CachecdError scrubs it besides).
                buf, err = None, errors.Internal(
                    f"upstream fetch of {req.file} failed: {type(exc).__name__}: {exc}")
            if stream is not None:
                await self._streamed(stream, states, buf is not None)
            done: list[_Assembly] = []
            for piece in req.pieces:
                st = states[piece.entry]
                if buf is None:
                    st.error = st.error or err
                elif stream is None:
                    st.parts[piece.part] = buf[piece.start - req.start : piece.end - req.start]
                st.pending -= 1
                if st.pending == 0:
                    done.append(st)
            del buf
            for st in done:
                await self._finish(manifest, st, on_verified, failures, spool)

        try:
            await asyncio.gather(*(run(r) for r in requests))
        finally:
            # Writers not taken by a commit (failed, cancelled) go: no temp outlives the fetch.
            for stream in streams:
                await stream.settle()
                for part in stream.parts:
                    spool.discard(part.entry)  # type: ignore[union-attr]
        return failures

    async def _from_peers(
        self,
        manifest: Any,
        entries: list[EntryLike],
        on_verified: OnVerified,
        failures: dict[ExpertKey, errors.CachecdError],
        spool: Spool | None,
    ) -> list[EntryLike]:
        """Hand over what peers served (verified there); return the entries still wanted.
        Where the source proves ranges (``xet_source``), a peer's bytes are proven as the
        Hub's are, against the content store's proof for each range: a digest is only the
        peer's word, and one it does not prove is refused and asked of the source."""
        prove = getattr(self.source, "prove_range", None)
        refused: set[ExpertKey] = set()

        async def hand(entry: EntryLike, got: memoryview | VectorWriter) -> None:
            key = (entry.layer, entry.expert)
            if prove is not None and not await self._peer_proven(manifest, entry, got, prove):
                refused.add(key)
                return
            await _contained(key, failures, lambda: on_verified(entry, got))

        # Proving reads the bytes back: gathered in memory, not spooled, then.
        got = await self.peers.fetch(entries, hand, spool if prove is None else None,  # type: ignore[union-attr]
                                     self._pool())
        return [e for e in entries if (e.layer, e.expert) not in got
                or (e.layer, e.expert) in refused]

    async def _peer_proven(self, manifest: Any, entry: EntryLike, got: Any,
                           prove: Callable[..., Awaitable[bool]]) -> bool:
        view, pos = memoryview(got), 0
        try:
            for r in entry.ranges:
                await prove(manifest, r.file, r.start, r.end, view[pos:pos + r.end - r.start])
                pos += r.end - r.start
            return True
        except Exception as exc:  # disproven, or not provable now: the source serves it
            self.source.count("peer_unproven")
            log.warning("event=peer_unproven repo=%s layer=%d expert=%d why=%r", manifest.repo,
                        entry.layer, entry.expert, exc)
            return False

    def _stream_for(
        self, req: RangeRequest, states: list[_Assembly], spool: Spool | None
    ) -> Stream | None:
        """A Stream for ``req`` when each of its experts is one whole range of it."""
        if spool is None or len({p.entry for p in req.pieces}) != len(req.pieces):
            return None
        if any(len(states[p.entry].entry.ranges) != 1 for p in req.pieces):
            return None
        pieces = [(p.entry, states[p.entry].entry, p.start, p.end) for p in req.pieces]
        return Stream(req.start, pieces, spool, self._pool())

    def _pool(self) -> ThreadPoolExecutor:
        if self._spill_pool is None:
            self._spill_pool = ThreadPoolExecutor(SPILL_THREADS, thread_name_prefix="cachecd-spill")
        return self._spill_pool

    async def _streamed(self, stream: Stream, states: list[_Assembly], got: bool) -> None:
        """After a streamed request: mark each expert ok (its writer stays in the spool), bad
        (the hash differs) or failed (a write failed: fetch it again the buffered way)."""
        wrote = await stream.settle()
        for part in stream.parts:
            st = states[part.index]
            if not got:
                continue  # st.error is set; the writer is discarded at the end of the batch
            if not wrote or part.failed or part.writer is None:
                st.streamed = "failed"
                continue
            try:
                verify_digest(st.entry, st.entry.nbytes, stream.digest(part))
                st.streamed = "ok"
            except errors.ChecksumMismatch as exc:
                st.streamed, st.error_first = "bad", exc

    async def fetch_range(self, manifest: Any, file: str, start: int, end: int) -> bytearray:
        """Exactly bytes [start, end) of ``file`` at the manifest's revision; the caller verifies."""
        if self.offline:
            raise self.source.offline_error(f"{file} of {manifest.key}")
        return await self.source.get_range(manifest, file, start, end)

    async def _finish(
        self,
        manifest: Any,
        st: _Assembly,
        on_verified: OnVerified,
        failures: dict[ExpertKey, errors.CachecdError],
        spool: Spool | None,
    ) -> None:
        async def hand_over() -> None:
            if st.error is not None:
                raise st.error
            got: memoryview | VectorWriter | None = None
            if st.streamed == "ok" and spool is not None:
                got = spool.take(st.entry)  # on_verified owns the writer from here
            if got is None:
                if st.streamed is not None and spool is not None:
                    spool.discard(st.entry)
                got = await self._verified(manifest, st)
            await on_verified(st.entry, got)

        try:
            await _contained((st.entry.layer, st.entry.expert), failures, hand_over)
        finally:
            st.parts = []

    async def _verified(self, manifest: Any, st: _Assembly) -> memoryview:
        entry = st.entry
        data = st.joined() if st.streamed is None else None
        for attempt in range(self.checksum_refetches + 1):
            if attempt:
                self.source.count("checksum_refetches")
            try:
                if st.streamed == "bad" and attempt == 0:
                    raise st.error_first  # type: ignore[misc]
                if attempt or data is None:
                    data = await self._fetch_alone(manifest, entry)
                await verify_async(entry, data)
                return data
            except errors.ChecksumMismatch as exc:
                self.source.count("faults_checksum")
                log.warning(
                    "checksum mismatch repo=%s layer=%d expert=%d attempt=%d",
                    manifest.repo,
                    entry.layer,
                    entry.expert,
                    attempt,
                )
                if _proven(self.source, manifest, entry):
                    raise _manifest_wrong(manifest, entry) from None
                last = exc
        raise errors.ChecksumMismatch(
            f"{last.message} ({self.checksum_refetches + 1} downloads, all wrong; nothing stored "
            f"or served). The bytes {self.source.where} serves for them at {manifest.revision} do not "
            f"hash to what the manifest ({getattr(manifest, 'source', manifest.repo)}) says: "
            "either the endpoint, or something between it and us, serves other bytes, or the "
            "manifest's hashes are wrong (a manifest you did not build is its maker's word: "
            f"`cachecd setup --stream {manifest.repo}@{manifest.revision} --build-manifest` makes "
            "your own)"
        )

    async def _fetch_alone(self, manifest: Any, entry: EntryLike) -> memoryview:
        parts = await asyncio.gather(
            *(self.source.get_range(manifest, r.file, r.start, r.end) for r in entry.ranges)
        )
        if len(parts) == 1:
            return memoryview(parts[0])
        return memoryview(bytearray().join(parts))


def _proven(source: ExpertSource, manifest: Any, entry: EntryLike) -> bool:
    """Whether every byte of ``entry`` came proven against the Hub's own hash of its file
    (``xet_source``): then refetching cannot help, the manifest is what is wrong."""
    proven = getattr(source, "proven", None)
    return proven is not None and all(proven(manifest, r.file) for r in entry.ranges)


def _manifest_wrong(manifest: Any, entry: EntryLike) -> errors.ManifestMismatch:
    files = ", ".join(sorted({r.file for r in entry.ranges}))
    return errors.ManifestMismatch(
        f"expert layer={entry.layer} expert={entry.expert}: its bytes from {files} at "
        f"{manifest.revision} are proven against the Hub's own Xet hash of the file, and their "
        f"xxh3 is not the one the manifest ({getattr(manifest, 'source', manifest.repo)}) gives: "
        "the manifest is wrong about this expert, which is refused (nothing stored or served, "
        "not fetched again). A manifest you did not build is its maker's word: `cachecd setup "
        f"--stream {manifest.repo}@{manifest.revision} --build-manifest` makes your own")
