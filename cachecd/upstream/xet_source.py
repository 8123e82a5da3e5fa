"""The Hub as a source of expert bytes, each file read through Xet where the Hub stores it there,
and every range proven against the Hub's own hash of the file before a byte of it is handed on.

Per file at the pinned commit, the one resolve the Hub client makes anyway (a HEAD that does not
follow the redirect, cached) says whether the Hub keeps it in Xet: its ``X-Xet-Hash``. A file
without one is read as before (``HubClient``: resolve + exact Range GET, the manifest's xxh3).
A file with one is read, per asked range [start, end):

1. a read token for the repo at the commit (``xet_token``: refreshed before ``exp``);
2. the proof: ``/v2/file-chunk-hashes`` with ``X-Range-Dirty`` gives the chunk-aligned window
   around the range and the Merkle subtrees of the gaps before and after it;
3. the window's reconstruction (``/v2/reconstructions`` with ``Range``) and its signed xorb ranges,
   fetched in parallel, their chunks decoded and hashed with keyed BLAKE3 on threads
   (``xet_read``);
4. ``proof.verify_window``: the window's chunk hashes merged with the gaps must give the file's
   Xet hash; only then are the range's bytes (cut from the window) handed on, to the same consumer
   the plain route feeds, so ``fetch.Upstream`` still computes and checks each expert's xxh3.

Invariants:
- No byte of a Xet file leaves ``get_range`` unless its window proved against the hash the Hub
  reported for that file at the manifest's commit (``X-Repo-Commit`` checked by the resolve).
- Unproven reads (a flipped byte, a bad chunk header, a wrong proof, a swapped xorb) are read again
  at most ``refetches`` times, then ``XetProofError`` (bytes and proof disagree) or
  ``XetFormatError`` (an answer the spec does not allow); nothing of them is returned.
- A 401 from the content store asks for a new token once; a 403 on a signed xorb URL asks for the
  reconstruction again (``URL_RENEWALS`` times); a 429 waits as the server says (``retry``).
- ``proven(manifest, file)``: whether that file's bytes come proven, so ``fetch.Upstream`` can tell
  a wrong manifest from a wrong upstream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from cachecd import constants, errors
from cachecd.manifest.safetensors_header import header_length
from cachecd.upstream.hub_client import READ_BUFSIZE, HubClient
from cachecd.upstream.retry import Retrier
from cachecd.upstream.source import Consumer, UseChecks
from cachecd.upstream.xet_cache import ChunkCache
from cachecd.upstream.xet_read import CasReader, Chunk, Refused, TokenRefused, UrlExpired
from cachecd.upstream.xet_token import XetTokens
from cachecd.upstream.xet_wire import Token
from cachecd.xet import chunking, hashing, proof

log = logging.getLogger(__name__)

T = TypeVar("T")
# A window may add this much to the asked range (the spec's rule adds 80-370 KB on random data);
# more is refused rather than downloaded.
WINDOW_SLACK = 64 << 20
URL_RENEWALS = 2


class XetSource:
    """``source.ExpertSource`` over ``hub``: Xet files proven, the others through ``hub``."""

    def __init__(self, hub: HubClient, *, refetches: int = constants.CHECKSUM_REFETCHES,
                 max_retries: int = constants.MAX_RETRIES,
                 backoff_base: float = constants.BACKOFF_BASE_S,
                 backoff_cap: float = constants.BACKOFF_CAP_S,
                 slack: int = WINDOW_SLACK) -> None:
        self.hub = hub
        self.where, self.offline, self.max_parallel = hub.where, hub.offline, hub.max_parallel
        self.refetches, self.slack = refetches, slack
        self._counters: Counter[str] = Counter()
        self._session: aiohttp.ClientSession | None = None
        self._files: dict[tuple[str, str, str], str] = {}  # -> its Xet hash, "" when not in Xet
        self.kept = ChunkCache(constants.XET_KEEP_BYTES)  # proven chunks: none read twice
        self._retry = Retrier(self._counters, max_parallel=hub.max_parallel,
                              max_retries=max_retries, backoff_base=backoff_base,
                              backoff_cap=backoff_cap, read_timeout=hub.read_timeout,
                              total_timeout=hub.total_timeout)
        timeout = aiohttp.ClientTimeout(total=hub.read_timeout + hub.connect_timeout,
                                        sock_connect=hub.connect_timeout,
                                        sock_read=hub.read_timeout)
        self.tokens = XetTokens(hub.endpoint, hub.auth, self._get_session,
                                lambda url, once, kind: self._retry.run(url, once, kind=kind),
                                hub._proxy, timeout)
        self.reader = CasReader(
            self._get_session,
            lambda url, once, kind, deadline: self._retry.run(url, once, deadline, kind=kind),
            hub._proxy, self._counters, connect_timeout=hub.connect_timeout,
            read_timeout=hub.read_timeout, user_agent=hub.auth.plain)

    @classmethod
    def from_settings(cls, settings: Any, token: str | bool | None = None) -> XetSource:
        return cls(HubClient.from_settings(settings, token))

    # -- what ExpertSource asks besides ranges ----------------------------------------------
    def use_checks(self, keep: Path, deadline_s: float) -> UseChecks:
        """The Hub client's, but the layout of a manifest whose shards are all in Xet is checked
        against headers read through Xet and proven (``proven_headers``), never against an
        unproven answer or one kept from earlier (docs/trust.md: a lying header kept once
        approved a pair-swapped manifest against the honest Hub)."""
        plain = self.hub.use_checks(keep, deadline_s)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return plain
        if self.offline:
            return plain

        def layout(manifest: Any) -> None:
            from cachecd.manifest.layout_check import check_layout

            run = asyncio.run_coroutine_threadsafe(self.proven_headers(manifest), loop)
            headers = run.result(deadline_s)
            if headers is None:
                plain.layout(manifest)
                return
            check_layout(manifest, headers)

        return UseChecks(plain.metadata, layout)

    async def _header(self, manifest: Any, file: str) -> bytearray:
        """The first 8 + N bytes of ``file``, N as its own first 8 bytes say (not the manifest)."""
        size = manifest.files[file].size
        head = await self.get_range(manifest, file, 0, min(size, 8))
        n = header_length(bytes(head), file)
        return await self.get_range(manifest, file, 0, min(size, 8 + n))

    async def proven_headers(self, manifest: Any) -> dict[str, bytes] | None:
        """Each shard's first 8 + N bytes (N: the manifest's header length), read through Xet
        and proven; None where a shard is not in Xet."""
        hashes = await asyncio.gather(*(self._xet_hash(manifest, f, keep=False)
                                        for f in manifest.shards))
        if not all(hashes):
            return None
        got = await asyncio.gather(*(self._header(manifest, f) for f in manifest.shards))
        self._counters["xet_proven_headers"] += len(got)
        return {f: bytes(data) for f, data in zip(manifest.shards, got, strict=True)}

    def stats(self) -> dict[str, int]:
        out = self.hub.stats()
        for key, value in self._counters.items():
            out[key] = max(out.get(key, 0), value) if key == "peak_in_flight" else \
                out.get(key, 0) + value
        out["in_flight"] = out.get("in_flight", 0) + self._retry.in_flight
        out["xet_token_requests"] = self.tokens.requests
        return out

    def count(self, name: str, n: int = 1) -> None:
        self.hub.count(name, n)

    def observe_requests(self, observe: Callable[[str, float], None]) -> None:
        self.hub.observe_requests(observe)
        self._retry.observe = observe

    def offline_error(self, what: str) -> errors.Offline:
        return self.hub.offline_error(what)

    async def close(self) -> None:
        await self.hub.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def proven(self, manifest: Any, file: str) -> bool:
        """Whether ``file``'s bytes are read through Xet and proven (known once it was read)."""
        return bool(self._files.get((manifest.repo, manifest.revision, file)))

    def routes(self) -> dict[str, str]:
        """``REPO@COMMIT`` -> "xet", "lfs" or "xet+lfs", for the files read since start."""
        out: dict[str, str] = {}
        for (repo, revision, _), file_hash in self._files.items():
            key, route = f"{repo}@{revision}", "xet" if file_hash else "lfs"
            out[key] = route if out.get(key, route) == route else "xet+lfs"
        return out

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.max_parallel + 4, ttl_dns_cache=300)
            # As the Hub client's: the bytes we decode are the bytes on the wire; no ~/.netrc.
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                                  read_bufsize=READ_BUFSIZE)
        return self._session

    # -- ranges ------------------------------------------------------------------------------
    async def get_range(
        self, manifest: Any, file: str, start: int, end: int, consumer: Consumer | None = None
    ) -> bytearray:
        if not 0 <= start < end:
            raise errors.InvalidRequest(f"empty or negative range {start}-{end} of {file}")
        file_hash = await self._xet_hash(manifest, file)
        if not file_hash:
            return await self.hub.get_range(manifest, file, start, end, consumer)
        kept = self.kept.covering(file_hash, start, end)
        if kept is None:
            chunks, origin = await self._proven(manifest, file, file_hash, start, end)
        else:
            chunks, origin = kept
            self._counters["xet_window_reuses"] += 1
        views = _cut(chunks, origin, start, end)
        self._counters["xet_range_bytes"] += end - start
        if consumer is None:
            return bytearray().join(views)
        await consumer.restart()
        pos = 0
        for view in views:
            consumer.feed(view, pos)  # type: ignore[arg-type]  # a memoryview: no copy
            pos += len(view)
        return bytearray()

    async def prove_range(self, manifest: Any, file: str, start: int, end: int,
                          data: memoryview) -> bool:
        """Prove bytes [start, end) of ``file`` that came from elsewhere (a peer): the content
        store's proof for the range, the window's widening read here (plain ranges: the proof
        checks them too), the window re-cut into its chunks (it starts on a stored cut) and
        hashed, the root against the file's Xet hash. True when proven; False when the file is
        not in Xet (nothing to prove against); ``XetProofError`` when they do not prove."""
        file_hash = await self._xet_hash(manifest, file)
        if not file_hash:
            return False
        info = manifest.files.get(file)
        deadline = time.monotonic() + self.hub.total_timeout
        window = await self._with_token(manifest, lambda tok: self.reader.window(
            tok, file_hash, start, end, size=info.size if info else None, slack=self.slack,
            deadline=deadline))
        before = await self._plain(manifest, file, file_hash, window.start, start)
        after = await self._plain(manifest, file, file_hash, end, window.end)
        whole = bytes(before) + bytes(data) + bytes(after)

        def check() -> list[Chunk]:
            ends = chunking.cut_points(whole)
            leaves = hashing.hash_chunks(whole, ends)
            proof.verify_window(hashing.from_hex(file_hash), window.answer, window.start, leaves,
                                want=(start, end))
            return [Chunk(whole[a:b], h) for a, b, (h, _) in zip([0, *ends], ends, leaves,
                                                                  strict=False)]

        # Proven now: its chunks are kept, so a neighbour's widening is not read again.
        self.kept.add(file_hash, window.start, await asyncio.to_thread(check))
        self._counters["xet_proven_elsewhere"] += 1
        return True

    async def _plain(self, manifest: Any, file: str, file_hash: str, a: int, b: int) -> bytes:
        if a >= b:
            return b""
        kept = self.kept.covering(file_hash, a, b)
        if kept is not None:
            return b"".join(_cut(*kept, a, b))
        return bytes(await self.hub.get_range(manifest, file, a, b))

    async def _xet_hash(self, manifest: Any, file: str, keep: bool = True) -> str:
        """``file``'s Xet hash at the manifest's commit ("" where it is not in Xet), from its
        resolve. ``keep`` off (the layout check): the resolve's signed location is not kept for
        the fetches, so a file read through the LFS route is resolved when first fetched, its
        answer (a refusal included) that fetch's, as without the check."""
        key = (manifest.repo, manifest.revision, file)
        known = self._files.get(key)
        if known is None:
            loc = await (self.hub.location(manifest, file) if keep
                         else self.hub._resolve(manifest, file))
            known = self._files[key] = loc.xet_hash or ""
            # DEBUG, as the resolve's own line: setup would print one per shard between its bars.
            log.debug("event=route repo=%s file=%s route=%s", manifest.repo, file,
                      "xet" if known else "lfs")
        return known

    async def _proven(self, manifest: Any, file: str, file_hash: str, start: int,
                      end: int) -> tuple[list[Chunk], int]:
        """The window's chunks around [start, end) and its first byte, proven; read again when
        they do not prove, at most ``refetches`` times."""
        deadline = time.monotonic() + self.hub.total_timeout
        info = manifest.files.get(file)
        size = info.size if info is not None else None
        last: Exception | None = None
        why = ""
        for attempt in range(self.refetches + 1):
            try:
                return await self._window(manifest, file_hash, start, end, size, deadline)
            except (Refused, errors.XetFormatError, errors.XetProofError) as exc:
                last, why = exc, str(exc)
                self._counters["faults_xet_unproven"] += 1
                log.warning("event=xet_unproven repo=%s file=%s start=%d end=%d attempt=%d why=%s",
                            manifest.repo, file, start, end, attempt, why)
        kind = errors.XetProofError if isinstance(last, errors.XetProofError) else \
            errors.XetFormatError
        raise kind(
            f"{file} bytes {start}-{end - 1} of {manifest.repo}@{manifest.revision[:12]}: read "
            f"through Xet {self.refetches + 1} times, and each time they did not prove against "
            f"the Hub's hash of the file at that commit ({file_hash[:16]}...): {why}. Nothing "
            "was stored or served. The content store, or something between it and us, serves "
            "other bytes; retry later, and report it if it persists")

    async def _window(self, manifest: Any, file_hash: str, start: int, end: int,
                      size: int | None, deadline: float) -> tuple[list[Chunk], int]:
        window = await self._with_token(manifest, lambda tok: self.reader.window(
            tok, file_hash, start, end, size=size, slack=self.slack, deadline=deadline))
        # The window's first and last chunks kept from earlier proven windows are not read again.
        head, a = self.kept.run_from(file_hash, window.start, window.end)
        tail, b = self.kept.run_to(file_hash, window.end, a)
        for _ in range(URL_RENEWALS + 1):
            if a >= b:
                chunks = head + tail
                break
            rec = await self._with_token(manifest, lambda tok: self.reader.reconstruction(
                tok, file_hash, a, b, deadline))
            try:
                chunks = head + await self.reader.chunks(rec, b - a, deadline) + tail
                break
            except UrlExpired:  # the signatures outlived: a new reconstruction signs anew
                self._counters["xet_urls_expired"] += 1
        else:
            raise errors.UpstreamError(
                f"the content store's signed xorb URLs for {manifest.repo} were refused (HTTP "
                f"403) {URL_RENEWALS + 1} times, each time freshly signed; retry later")
        leaves = [(c.hash, len(c.data)) for c in chunks]
        await asyncio.to_thread(proof.verify_window, hashing.from_hex(file_hash), window.answer,
                                window.start, leaves, want=(start, end))
        self.kept.add(file_hash, window.start, chunks)
        self._counters["xet_kept_chunk_bytes"] += (a - window.start) + (window.end - b)
        self._counters["xet_windows"] += 1
        self._counters["xet_window_bytes"] += window.end - window.start
        return chunks, window.start

    async def _with_token(self, manifest: Any, call: Callable[[Token], Awaitable[T]]) -> T:
        """``call`` with the repo's read token; once more with a new one after a 401."""
        repo, revision = manifest.repo, manifest.revision
        token = await self.tokens.get(repo, revision)
        try:
            return await call(token)
        except TokenRefused:
            self._counters["xet_tokens_refused"] += 1
            self.tokens.refused(repo, revision, token)
        token = await self.tokens.get(repo, revision)
        try:
            return await call(token)
        except TokenRefused:
            raise errors.Unauthorized(
                f"the Xet content store refused a fresh read token for {repo}@{revision[:12]} "
                "(HTTP 401); check the token's access to this repo") from None


def _cut(chunks: list[Chunk], origin: int, start: int, end: int) -> list[memoryview]:
    """Views of bytes [start, end) of the file, from ``chunks`` laid end to end at ``origin``."""
    out, pos = [], origin
    for chunk in chunks:
        a, b = max(start, pos), min(end, pos + len(chunk.data))
        if a < b:
            out.append(memoryview(chunk.data)[a - pos : b - pos])
        pos += len(chunk.data)
        if pos >= end:
            break
    return out
