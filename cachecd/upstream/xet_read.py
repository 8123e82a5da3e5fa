"""Reading one window of a file from a Xet content store: its proof, its reconstruction, the
signed xorb ranges, the chunks decoded and hashed.

What comes back is the window's chunks in file order, each with its keyed-BLAKE3 hash: what
``proof.verify_window`` takes. Nothing here decides whether bytes are good (``xet_source`` proves
them against the file's hash); this module only refuses answers it cannot use.

Invariants:
- Every request goes through the caller's ``Retrier`` (the parallel limit, a 429's wait, backoff
  on 5xx and broken connections); a 401 from the content store is ``TokenRefused`` (the caller
  asks for a new token), a 403 on a signed xorb URL is ``UrlExpired`` (the caller asks for the
  reconstruction again), an answer that breaks the spec is ``Refused``.
- The Xet token goes to the content store's API only; signed xorb URLs get no Authorization.
  Neither a token nor a URL's query string appears in a message or a log line.
- Bodies are read within bounds: JSON answers up to ``MAX_JSON``, a xorb range exactly its
  length (a longer or shorter body is a fault).
- Decoding and hashing run on worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from cachecd import errors
from cachecd.upstream import hub_http as hh
from cachecd.upstream.retry import Transient
from cachecd.upstream.xet_wire import (
    Reconstruction,
    Token,
    Window,
    WireError,
    XorbFetch,
    XorbRange,
    parse_reconstruction,
    parse_window,
)
from cachecd.xet import hashing, xorb

MAX_JSON = 16 << 20
READ_STEP = 1 << 20

Run = Callable[[str, Callable[[], Awaitable[Any]], str, float], Awaitable[Any]]


class TokenRefused(Exception):
    """The content store answered 401: the token expired or was revoked."""


class UrlExpired(Exception):
    """A signed xorb URL answered 403: its signature expired."""


class Refused(Exception):
    """An answer the spec does not allow (malformed JSON, chunks that do not decode, lengths
    that disagree): these bytes are not used."""


@dataclass(frozen=True)
class Chunk:
    data: bytes
    hash: bytes


def bare(url: str) -> str:
    """``url`` without its query (a signature) for messages."""
    return urlsplit(url)._replace(query="", fragment="").geturl()


class CasReader:
    """Requests to the content store a token names. ``counters`` gets requests, bytes, hashing
    time (``xet_hash_us``) and decoding time."""

    def __init__(self, session: Callable[[], aiohttp.ClientSession], run: Run,
                 proxy: Callable[[str], str | None], counters: Counter[str], *,
                 connect_timeout: float, read_timeout: float, user_agent: dict[str, str]) -> None:
        self._session, self._run, self._proxy = session, run, proxy
        self._counters = counters
        self._connect, self._read = connect_timeout, read_timeout
        self._plain = user_agent
        self._v1_only: set[str] = set()  # content stores that answered /v2 with 404 or 501

    def _timeout(self, deadline: float) -> aiohttp.ClientTimeout:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise errors.UpstreamTimeout("the total deadline passed while reading through Xet")
        return aiohttp.ClientTimeout(total=remaining, sock_connect=self._connect,
                                     sock_read=self._read)

    # -- the content store's JSON API -------------------------------------------------------
    async def window(self, token: Token, file_hash: str, start: int, end: int, *,
                     size: int | None, slack: int, deadline: float) -> Window:
        """The proof's window for bytes [start, end): ``/v2/file-chunk-hashes``."""
        url = f"{token.cas_url}/v2/file-chunk-hashes/{file_hash}"
        headers = {"X-Range-Dirty": f"bytes={start}-{end - 1}"}
        doc, n = await self._json(url, token, headers, "xet_proof", deadline)
        self._counters["xet_proof_bytes"] += n
        try:
            return parse_window(doc, start, end, size=size, slack=slack)
        except WireError as exc:
            raise Refused(f"file-chunk-hashes: {exc}") from None

    async def reconstruction(self, token: Token, file_hash: str, start: int, end: int,
                             deadline: float) -> Reconstruction:
        """Where bytes [start, end) live: ``/v2/reconstructions``, ``/v1`` where v2 is absent."""
        headers = {"Range": f"bytes={start}-{end - 1}"}
        for version in ("v2", "v1"):
            if version == "v2" and token.cas_url in self._v1_only:
                continue
            url = f"{token.cas_url}/{version}/reconstructions/{file_hash}"
            try:
                doc, n = await self._json(url, token, headers, "xet_reconstruction", deadline,
                                          absent_ok=version == "v2")
            except _Absent:  # an older content store: v1 from now on
                self._counters["xet_v1_fallbacks"] += 1
                self._v1_only.add(token.cas_url)
                continue
            self._counters["xet_reconstruction_bytes"] += n
            try:
                return parse_reconstruction(doc, v1=version == "v1")
            except WireError as exc:
                raise Refused(f"reconstruction: {exc}") from None
        raise AssertionError("unreachable")

    async def _json(self, url: str, token: Token, headers: dict[str, str], kind: str,
                    deadline: float, absent_ok: bool = False) -> tuple[Any, int]:
        async def once() -> tuple[Any, int]:
            self._counters[f"requests_{kind}"] += 1
            sent = {**self._plain, **headers, "Authorization": f"Bearer {token.access_token}",
                    "Accept-Encoding": "identity"}
            async with self._session().get(url, headers=sent, allow_redirects=False,
                                           timeout=self._timeout(deadline),
                                           proxy=self._proxy(url)) as resp:
                body = await resp.content.read(MAX_JSON + 1)
                if resp.status == 401:
                    raise TokenRefused()
                if absent_ok and resp.status in (404, 501):
                    raise _Absent()
                if resp.status != 200:
                    raise _failure(resp, body, f"{kind} {bare(url)}")
                if len(body) > MAX_JSON:
                    raise Refused(f"{kind}: answer over {MAX_JSON} bytes")
                try:
                    return json.loads(body), len(body)
                except ValueError:
                    raise Refused(f"{kind}: answer is not JSON") from None

        result: tuple[Any, int] = await self._run(url, once, kind, deadline)
        return result

    # -- the chunks -------------------------------------------------------------------------
    async def chunks(self, rec: Reconstruction, length: int, deadline: float) -> list[Chunk]:
        """The decoded, hashed chunks of ``rec``'s terms in order; they must hold exactly
        ``length`` bytes from its first byte (the window starts on a chunk)."""
        if rec.offset != 0:
            raise Refused(f"reconstruction starts {rec.offset} bytes into its first chunk, not on "
                          "the window's first chunk")
        parts = await asyncio.gather(*(self._fetch(f, deadline) for f in rec.fetches))
        decoded = await asyncio.gather(*(
            asyncio.to_thread(self._decode, f, bodies) for f, bodies in zip(rec.fetches, parts,
                                                                           strict=True)))
        held: dict[tuple[str, int], Chunk] = {}
        for got in decoded:
            held.update(got)
        out: list[Chunk] = []
        for i, term in enumerate(rec.terms):
            try:
                chunks = [held[(term.xorb, c)] for c in range(term.start, term.end)]
            except KeyError:
                raise Refused(f"terms[{i}]: a chunk of {term.xorb[:12]} was not fetched") from None
            if sum(len(c.data) for c in chunks) != term.unpacked:
                raise Refused(f"terms[{i}]: chunks decode to another length than its "
                              f"unpacked_length {term.unpacked}")
            out.extend(chunks)
        if sum(len(c.data) for c in out) != length:
            raise Refused(f"the reconstruction holds {sum(len(c.data) for c in out)} bytes, the "
                          f"window {length}")
        return out

    def _decode(self, fetch: XorbFetch, bodies: list[bytearray]) -> dict[tuple[str, int], Chunk]:
        """On a worker thread: each range's chunks decoded (headers, LZ4, byte grouping) and
        hashed with the chunk key."""
        out: dict[tuple[str, int], Chunk] = {}
        hashing_s = 0.0
        for r, body in zip(fetch.ranges, bodies, strict=True):
            n = r.chunk_end - r.chunk_start
            try:
                datas = xorb.decode_chunks(memoryview(body), expect=n)
            except Exception as exc:  # XetFormatError, or any decoder failure on bad bytes
                raise Refused(f"xorb {fetch.xorb[:12]} bytes {r.byte_start}-{r.byte_end}: "
                              f"{exc}") from None
            if len(datas) != n:
                raise Refused(f"xorb {fetch.xorb[:12]}: {len(datas)} chunks where {n} were listed")
            started = time.perf_counter()
            for k, data in enumerate(datas):
                out[(fetch.xorb, r.chunk_start + k)] = Chunk(data, hashing.chunk_hash(data))
            hashing_s += time.perf_counter() - started
        self._counters["xet_hash_us"] += int(hashing_s * 1e6)
        return out

    async def _fetch(self, fetch: XorbFetch, deadline: float) -> list[bytearray]:
        """The bytes of each of ``fetch``'s ranges: one GET with all of them, as signed."""
        spec = ",".join(f"{r.byte_start}-{r.byte_end}" for r in fetch.ranges)
        what = f"xorb {fetch.xorb[:12]} bytes {spec[:60]}"

        async def once() -> list[bytearray]:
            self._counters["requests_xet_xorb"] += 1
            headers = {**self._plain, "Range": f"bytes={spec}", "Accept-Encoding": "identity"}
            async with self._session().get(fetch.url, headers=headers, allow_redirects=False,
                                           timeout=self._timeout(deadline),
                                           proxy=self._proxy(fetch.url)) as resp:
                if resp.status == 403:
                    raise UrlExpired()
                if resp.status != 206:
                    if resp.status == 200:
                        resp.close()
                        raise Transient(errors.BadUpstreamRange(
                            f"{what}: answered 200 (the whole xorb) instead of 206"),
                            "xet_ignored_range")
                    body = await resp.content.read(hh.MAX_BODY_SNIPPET)
                    raise _failure(resp, body, what)
                if len(fetch.ranges) == 1:
                    return [await self._single(resp, fetch.ranges[0], what)]
                return await self._multipart(resp, fetch.ranges, what)

        bodies: list[bytearray] = await self._run(fetch.url, once, "xet_xorb", deadline)
        n = sum(len(b) for b in bodies)
        self._counters["bytes"] += n
        self._counters["xet_xorb_bytes"] += n
        return bodies

    async def _single(self, resp: aiohttp.ClientResponse, r: XorbRange, what: str) -> bytearray:
        got = hh.parse_content_range(resp.headers.get("Content-Range"))
        if got is None or got[:2] != (r.byte_start, r.byte_end + 1):
            resp.close()
            raise Transient(errors.BadUpstreamRange(
                f"{what}: Content-Range {resp.headers.get('Content-Range')!r} is not what was "
                "asked"), "xet_content_range")
        return await _exactly(resp.content.iter_any(), r.length, what, resp.close)

    async def _multipart(self, resp: aiohttp.ClientResponse, ranges: tuple[XorbRange, ...],
                         what: str) -> list[bytearray]:
        """A multipart/byteranges answer: each part matched to its range by Content-Range."""
        wanted = {(r.byte_start, r.byte_end + 1): i for i, r in enumerate(ranges)}
        out: list[bytearray | None] = [None] * len(ranges)
        reader = aiohttp.MultipartReader(resp.headers, resp.content)
        while (part := await reader.next()) is not None:
            if not isinstance(part, aiohttp.BodyPartReader):
                raise _short(what, "a nested multipart part", resp.close)
            got = hh.parse_content_range(part.headers.get("Content-Range"))
            i = wanted.get(got[:2]) if got is not None else None
            if i is None or out[i] is not None:
                raise _short(what, f"a part for {part.headers.get('Content-Range')!r}", resp.close)

            async def steps(part: aiohttp.BodyPartReader = part) -> Any:
                while chunk := await part.read_chunk(READ_STEP):
                    yield chunk

            out[i] = await _exactly(steps(), ranges[i].length, what, resp.close)
        if any(b is None for b in out):
            raise _short(what, "parts missing", resp.close)
        return [b for b in out if b is not None]


class _Absent(Exception):
    """``/v2`` is not served here (404, 501): ask ``/v1``."""


async def _exactly(chunks: Any, length: int, what: str, close: Callable[[], None]) -> bytearray:
    """Exactly ``length`` bytes from ``chunks``, into one buffer allocated once."""
    buf, pos = bytearray(length), 0
    for_write = memoryview(buf)
    async for chunk in chunks:
        if pos + len(chunk) > length:
            close()
            raise _short(what, f"a body longer than the {length} bytes asked", close)
        for_write[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    if pos != length:
        raise _short(what, f"a body of {pos} of {length} bytes", close)
    return buf


def _short(what: str, detail: str, close: Callable[[], None]) -> Transient:
    close()
    return Transient(errors.BadUpstreamRange(f"{what}: {detail}"), "xet_body")


def _failure(resp: aiohttp.ClientResponse, body: bytes, what: str) -> Exception:
    rid = resp.headers.get("X-Request-Id")
    message = resp.headers.get("X-Error-Message", "").encode() or body
    err = hh.error_for_status(resp.status, message, rid, what, on_resolve=False)
    if hh.is_retryable_status(resp.status):
        return Transient(err, f"xet_status_{resp.status}", hh.server_wait(resp.headers))
    return err
