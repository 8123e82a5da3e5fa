"""The upstream: exact, verified byte ranges of a pinned revision from a Hub endpoint.

Invariants:
- ``on_verified`` is called only with bytes whose xxh3-128 equals the manifest's; bad bytes are
  dropped, refetched at most ``checksum_refetches`` times, then reported as ChecksumMismatch.
- A byte range is accepted only from a 206 whose Content-Range is exactly what was asked (and the
  manifest's file size) and whose body has exactly the asked length.
- ``/resolve`` is asked once per (repo, revision, file); its signed Location is reused until it
  expires or the CDN answers 403 (then resolved again, once).
- The token goes only to the endpoint's ``/resolve``, never to the Location, and never into a
  log line or error message.
- No request to a host before the time that host last asked us to wait (Retry-After, RateLimit).
- At most ``max_parallel`` range requests are open at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from cachecd import constants, errors
from cachecd.hub_client import HubClient
from cachecd.hub_plan import DEFAULT_MAX_GAP, EntryLike, plan_requests
from cachecd.verify import verify_async

log = logging.getLogger(__name__)

OnVerified = Callable[[Any, memoryview], Awaitable[None]]
ExpertKey = tuple[int, int]


class _Assembly:
    """The pieces of one expert as they arrive from (possibly) several requests."""

    __slots__ = ("entry", "error", "parts", "pending")

    def __init__(self, entry: EntryLike) -> None:
        self.entry = entry
        self.parts: list[memoryview | None] = [None] * len(entry.ranges)
        self.pending = len(entry.ranges)
        self.error: errors.CachecdError | None = None

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


class Upstream(HubClient):
    """Fetches experts' bytes from ``endpoint`` (huggingface.co, a mirror, ``cachecd hub serve``).

    ``token`` is sent as-is (resolve it with ``huggingface_hub.get_token()``); None sends none.
    Create and close it inside the daemon's event loop.
    """

    def __init__(
        self,
        endpoint: str,
        token: str | None,
        *,
        offline: bool = False,
        max_parallel: int = constants.MAX_PARALLEL_FETCHES,
        connect_timeout: float = constants.CONNECT_TIMEOUT_S,
        read_timeout: float = constants.READ_TIMEOUT_S,
        total_timeout: float = constants.TOTAL_TIMEOUT_S,
        max_retries: int = constants.MAX_RETRIES,
        backoff_base: float = constants.BACKOFF_BASE_S,
        backoff_cap: float = constants.BACKOFF_CAP_S,
        coalesce_max_bytes: int = constants.COALESCE_MAX_BYTES,
        coalesce_max_experts: int = constants.COALESCE_MAX_EXPERTS,
        coalesce_max_gap: int = DEFAULT_MAX_GAP,
        checksum_refetches: int = constants.CHECKSUM_REFETCHES,
        signed_url_ttl: float = constants.SIGNED_URL_TTL_S,
    ) -> None:
        super().__init__(
            endpoint,
            token,
            offline=offline,
            max_parallel=max_parallel,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            total_timeout=total_timeout,
            max_retries=max_retries,
            backoff_base=backoff_base,
            backoff_cap=backoff_cap,
            signed_url_ttl=signed_url_ttl,
        )
        self.coalesce_max_bytes = coalesce_max_bytes
        self.coalesce_max_experts = coalesce_max_experts
        self.coalesce_max_gap = coalesce_max_gap
        self.checksum_refetches = checksum_refetches

    async def fetch_experts(
        self, manifest: Any, entries: Sequence[EntryLike], on_verified: OnVerified
    ) -> dict[ExpertKey, errors.CachecdError]:
        """Fetch, verify and hand over every entry; return the errors of those that failed.

        ``on_verified(entry, view)`` runs once per verified expert; ``view`` may point into a
        larger download buffer, so copy or write it before returning rather than keeping it.
        An error raised by ``on_verified`` becomes that expert's error.
        """
        if self.offline:
            raise self.offline_error(f"{len(entries)} expert(s) of {manifest.key}")
        unique = list({(e.layer, e.expert): e for e in entries}.values())
        states = [_Assembly(e) for e in unique]
        requests = plan_requests(
            unique,
            max_bytes=self.coalesce_max_bytes,
            max_experts=self.coalesce_max_experts,
            max_gap=self.coalesce_max_gap,
            parallel=self.max_parallel,
        )
        failures: dict[ExpertKey, errors.CachecdError] = {}

        async def run(req: Any) -> None:
            try:
                buf: memoryview | None = memoryview(
                    await self.get_range(manifest, req.file, req.start, req.end)
                )
            except errors.CachecdError as exc:
                buf, err = None, exc
            except Exception as exc:  # a bug must fail these experts, not the whole batch
                log.exception("upstream request failed file=%s", req.file)
                buf, err = None, errors.Internal(f"upstream fetch failed: {exc!r}")
            done: list[_Assembly] = []
            for piece in req.pieces:
                st = states[piece.entry]
                if buf is None:
                    st.error = st.error or err
                else:
                    st.parts[piece.part] = buf[piece.start - req.start : piece.end - req.start]
                st.pending -= 1
                if st.pending == 0:
                    done.append(st)
            del buf
            for st in done:
                await self._finish(manifest, st, on_verified, failures)

        await asyncio.gather(*(run(r) for r in requests))
        return failures

    async def fetch_range(self, manifest: Any, file: str, start: int, end: int) -> bytearray:
        """Exactly bytes [start, end) of ``file`` at the manifest's revision; the caller verifies."""
        if self.offline:
            raise self.offline_error(f"{file} of {manifest.key}")
        return await self.get_range(manifest, file, start, end)

    async def _finish(
        self,
        manifest: Any,
        st: _Assembly,
        on_verified: OnVerified,
        failures: dict[ExpertKey, errors.CachecdError],
    ) -> None:
        key = (st.entry.layer, st.entry.expert)
        try:
            if st.error is not None:
                raise st.error
            data = await self._verified(manifest, st)
            await on_verified(st.entry, data)
        except errors.CachecdError as exc:
            failures[key] = exc
        except Exception as exc:  # on_verified is someone else's code: contain its bugs
            log.exception("on_verified failed layer=%d expert=%d", *key)
            failures[key] = errors.Internal(f"storing expert {key} failed: {exc!r}")
        finally:
            st.parts = []

    async def _verified(self, manifest: Any, st: _Assembly) -> memoryview:
        entry = st.entry
        data = st.joined()
        for attempt in range(self.checksum_refetches + 1):
            if attempt:
                self.count("checksum_refetches")
                data = await self._fetch_alone(manifest, entry)
            try:
                await verify_async(entry, data)
                return data
            except errors.ChecksumMismatch as exc:
                self.count("faults_checksum")
                log.warning(
                    "checksum mismatch repo=%s layer=%d expert=%d attempt=%d",
                    manifest.repo,
                    entry.layer,
                    entry.expert,
                    attempt,
                )
                last = exc
        raise errors.ChecksumMismatch(
            f"{last.message} ({self.checksum_refetches + 1} downloads, all wrong); "
            "the upstream or something between it and us is corrupting data"
        )

    async def _fetch_alone(self, manifest: Any, entry: EntryLike) -> memoryview:
        parts = await asyncio.gather(
            *(self.get_range(manifest, r.file, r.start, r.end) for r in entry.ranges)
        )
        if len(parts) == 1:
            return memoryview(parts[0])
        return memoryview(bytearray().join(parts))
