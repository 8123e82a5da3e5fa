"""The Hub as a source of expert bytes (``source.ExpertSource``): one exact Range GET against a
Hub endpoint, with resolve caching and timeouts; retries and waits are ``retry.Retrier``'s.

Invariants (``fetch.Upstream`` builds on them):
- ``get_range`` returns exactly ``end - start`` bytes taken from a 206 whose Content-Range is
  exactly ``bytes start-(end-1)/size``; anything else is a fault, retried, then an error.
- One ``/resolve`` per (repo, revision, file) until the signed Location expires or the CDN answers
  403; concurrent resolves of one file share one request. The Location keeps the resolve's
  ``X-Xet-Hash`` (the file's hash in Xet at that commit), which ``xet_source`` reads by.
- The Authorization header is built for the endpoint's ``/resolve`` only; the token is found
  again before each resolve and after a 401 (``hub_auth``), so a login needs no restart.
- Each request goes through the proxy the environment names for its URL (``hub_http.proxy_for``).
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import aiohttp
from huggingface_hub import hf_hub_url

from cachecd import constants, errors
from cachecd.upstream import hub_http as hh
from cachecd.upstream.hub_auth import HubAuth
from cachecd.upstream.retry import DeadlinePassed, Retrier, Transient
from cachecd.upstream.singleflight import SingleFlight
from cachecd.upstream.source import Consumer, UseChecks, offline_error

log = logging.getLogger(__name__)

_REDIRECTS = (301, 302, 303, 307, 308)
_SHA256 = _XET_HASH = re.compile(r"[0-9a-f]{64}")
_EXPIRY_MARGIN_S = 60.0
# aiohttp pauses the socket when its buffer passes 2x this; 64 KiB (the default) stalls fast streams.
READ_BUFSIZE = 1 << 20


@dataclass(frozen=True)
class Location:
    url: str
    redirected: bool  # True: a CDN URL (no token); False: the resolve URL itself (token)
    expires_at: float  # time.monotonic()
    # The Hub's Xet hash of the file at the pinned commit (X-Xet-Hash), when it stores it in Xet.
    xet_hash: str | None = None


class _CdnForbidden(Exception):
    pass


class HubClient:
    """Ranges of a repo's files from ``endpoint`` (huggingface.co, a mirror, ``cachecd hub
    serve``).

    ``token``: a string is sent as-is; None follows huggingface_hub's ``get_token()`` (HF_TOKEN,
    then the token file), asked again before each resolve, so ``hf auth login`` counts without a
    restart; False sends none. Create and close it inside the event loop that uses it.
    """

    def __init__(
        self,
        endpoint: str,
        token: str | bool | None,
        *,
        offline: bool = False,
        max_parallel: int = constants.MAX_PARALLEL_FETCHES,
        connect_timeout: float = constants.CONNECT_TIMEOUT_S,
        read_timeout: float = constants.READ_TIMEOUT_S,
        total_timeout: float = constants.TOTAL_TIMEOUT_S,
        max_retries: int = constants.MAX_RETRIES,
        backoff_base: float = constants.BACKOFF_BASE_S,
        backoff_cap: float = constants.BACKOFF_CAP_S,
        signed_url_ttl: float = constants.SIGNED_URL_TTL_S,
    ) -> None:
        self.endpoint = self.where = endpoint.rstrip("/")
        self.offline = offline
        self.max_parallel = max_parallel
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.total_timeout = total_timeout
        self.signed_url_ttl = signed_url_ttl
        self.auth = HubAuth(token)
        self._proxies: dict[str, str | None] = {}  # scheme://host -> its proxy
        self._session: aiohttp.ClientSession | None = None
        self._locations: dict[tuple[str, str, str], Location] = {}
        self._resolving: SingleFlight[tuple[str, str, str, str], Location] = SingleFlight()
        self._counters: Counter[str] = Counter()
        self._retry = Retrier(
            self._counters, max_parallel=max_parallel, max_retries=max_retries,
            backoff_base=backoff_base, backoff_cap=backoff_cap, read_timeout=read_timeout,
            total_timeout=total_timeout,
        )

    @classmethod
    def from_settings(cls, settings: Any, token: str | bool | None = None) -> HubClient:
        """The Hub the settings name (``endpoint``, ``offline``, the parallel limit and the
        timeouts)."""
        return cls(settings.endpoint, token, offline=settings.offline,
                   max_parallel=settings.max_parallel, read_timeout=settings.read_timeout,
                   total_timeout=settings.total_timeout)

    def use_checks(self, keep: Path, deadline_s: float) -> UseChecks:
        """The Hub's metadata for the commit (none offline), and the layout against the shards'
        headers, kept in ``keep`` or fetched one at a time (huggingface_hub's client would keep
        more connections open for the daemon's life), asked again once, within ``deadline_s``."""
        endpoint, offline = self.endpoint, self.offline

        def metadata(manifest: Any) -> None:
            from huggingface_hub import get_token

            from cachecd.manifest.hub_check import check_metadata

            check_metadata(manifest, endpoint=endpoint, token=get_token())

        def layout(manifest: Any) -> None:
            from huggingface_hub import get_token

            from cachecd.manifest.hub_check import check_layout_at

            check_layout_at(manifest, endpoint=endpoint, token=None if offline else get_token(),
                            keep=keep, offline=offline, retry=False, parallel=1,
                            deadline_s=deadline_s)

        return UseChecks(None if offline else metadata, layout)

    # -- lifecycle and bookkeeping -----------------------------------------------------------
    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def stats(self) -> dict[str, int]:
        """Counters for /metrics: requests, resolves, bytes, retries, faults_<kind>, in flight."""
        out = dict(self._counters)
        out["in_flight"] = self._retry.in_flight
        return out

    def count(self, name: str, n: int = 1) -> None:
        self._counters[name] += n

    def observe_requests(self, observe: Callable[[str, float], None]) -> None:
        """``observe(kind, seconds)`` after each request sent upstream ("resolve", "range")."""
        self._retry.observe = observe

    def offline_error(self, what: str) -> errors.Offline:
        return offline_error(what)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.max_parallel + 4, ttl_dns_cache=300)
            # auto_decompress off: the bytes we hash are the bytes on the wire.
            # trust_env off: proxies come from proxy_for (read once), and aiohttp's own reading
            # would also take ~/.netrc logins, which clash with the token's header.
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, read_bufsize=READ_BUFSIZE
            )
        return self._session

    def _proxy(self, url: str) -> str | None:
        parts = urlsplit(url)
        key = f"{parts.scheme}://{parts.netloc}"
        if key not in self._proxies:
            self._proxies[key] = hh.proxy_for(url, constants.PROXIES)
            if self._proxies[key] is not None:
                log.info("event=proxied host=%s", parts.hostname)
        return self._proxies[key]

    # -- resolve -----------------------------------------------------------------------------
    async def location(self, manifest: Any, file: str, failed: str | None = None) -> Location:
        """The cached Location of ``file``, resolving it when absent, expired or just refused."""
        key = (manifest.repo, manifest.revision, file)
        loc = self._locations.get(key)
        if loc is not None and loc.expires_at > time.monotonic() and loc.url != failed:
            return loc
        loc = await self._resolving.do((*key, failed or ""), lambda: self._resolve(manifest, file))
        self._locations[key] = loc
        return loc

    async def _resolve(self, manifest: Any, file: str) -> Location:
        url = hf_hub_url(manifest.repo, file, revision=manifest.revision, endpoint=self.endpoint)
        await self.auth.refresh()
        try:
            return await self._retry.run(url, lambda: self._head(url, manifest, file),
                                         kind="resolve")
        except errors.Unauthorized:
            if not await self.auth.refresh():  # a token that changed while this one was refused
                raise
        return await self._retry.run(url, lambda: self._head(url, manifest, file), kind="resolve")

    async def _head(self, url: str, manifest: Any, file: str) -> Location:
        self.count("requests_resolve")
        self.count("resolves")
        timeout = aiohttp.ClientTimeout(
            total=self.read_timeout + self.connect_timeout,
            sock_connect=self.connect_timeout,
            sock_read=self.read_timeout,
        )
        headers = {**self.auth.headers, "Accept-Encoding": "identity"}
        async with self._get_session().head(
            url, headers=headers, allow_redirects=False, timeout=timeout, proxy=self._proxy(url)
        ) as resp:
            rid = resp.headers.get("X-Request-Id")
            what = f"resolve {manifest.repo}@{manifest.revision[:12]} {file}"
            if resp.status not in _REDIRECTS and resp.status != 200:
                raise self._status_failure(resp, b"", rid, what, on_resolve=True)
            _check_identity(resp.headers, manifest, file, rid)
            spent = hh.quota_spent_wait(resp.headers)
            if spent is not None:  # the next resolve would be refused: wait for the new window
                self.count("ratelimit_waits")
                self._retry.pause(url, spent)
            target = resp.headers.get("Location") if resp.status in _REDIRECTS else None
            xet = (resp.headers.get("X-Xet-Hash") or "").lower()
            xet_hash = xet if _XET_HASH.fullmatch(xet) else None
        # DEBUG: routine, once per file; `setup` would print one line per shard between its bars.
        log.debug("resolved repo=%s file=%s redirected=%s", manifest.repo, file, target is not None)
        if target is None:
            return Location(url, False, time.monotonic() + self.signed_url_ttl, xet_hash)
        target = urljoin(url, target)
        wall_expiry = hh.signed_url_expiry(target)
        ttl = self.signed_url_ttl if wall_expiry is None else wall_expiry - time.time()
        # A minute's margin on the Hub's hour; a tenth of a shorter life, so a URL that lives
        # seconds is still used for those seconds rather than resolved again at every request.
        margin = min(_EXPIRY_MARGIN_S, ttl / 10)
        return Location(target, True, time.monotonic() + max(0.0, ttl - margin), xet_hash)

    # -- range GET ---------------------------------------------------------------------------
    async def get_range(
        self, manifest: Any, file: str, start: int, end: int, consumer: Consumer | None = None
    ) -> bytearray:
        """The bytes; with ``consumer`` they go to it instead and an empty buffer is returned."""
        if not 0 <= start < end:
            raise errors.InvalidRequest(f"empty or negative range {start}-{end} of {file}")
        info = manifest.files.get(file)
        size = info.size if info is not None else None
        if size is not None and end > size:
            raise errors.InvalidRequest(f"range {start}-{end} runs past {file} ({size} bytes)")
        deadline = time.monotonic() + self.total_timeout
        failed: str | None = None
        for _ in range(2):  # again after the CDN refused a (stale) signed URL, or a new token
            loc = await self.location(manifest, file, failed)

            def once(loc: Location = loc) -> Any:
                return self._get_once(loc, file, start, end, size, deadline, consumer)

            try:
                return await self._retry.run(loc.url, once, deadline)
            except _CdnForbidden:
                self.count("faults_cdn_403")
                failed = loc.url
            except errors.Unauthorized:
                # The endpoint serves the bytes itself, with the token: resolve again with a
                # token that changed since, else this is the answer.
                if loc.redirected or not await self.auth.refresh():
                    raise
                failed = loc.url
        raise errors.UpstreamError(
            f"the CDN refused {file} twice (HTTP 403), even with a freshly resolved location; "
            "check the token's access to this repo"
        )

    async def _get_once(
        self,
        loc: Location,
        file: str,
        start: int,
        end: int,
        size: int | None,
        deadline: float,
        consumer: Consumer | None,
    ) -> bytearray:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlinePassed(
                f"total deadline of {self.total_timeout}s passed for {file}"
            )
        timeout = aiohttp.ClientTimeout(
            total=remaining, sock_connect=self.connect_timeout, sock_read=self.read_timeout
        )
        if consumer is not None:
            await consumer.restart()
        base = self.auth.plain if loc.redirected else self.auth.headers
        headers = {**base, "Accept-Encoding": "identity", "Range": f"bytes={start}-{end - 1}"}
        self.count("requests_range")
        async with self._get_session().get(
            loc.url, headers=headers, allow_redirects=False, timeout=timeout,
            proxy=self._proxy(loc.url),
        ) as resp:
            rid = resp.headers.get("X-Request-Id")
            what = f"GET {file} bytes {start}-{end - 1}"
            if resp.status == 403 and loc.redirected:
                raise _CdnForbidden()
            if resp.status != 206:
                if resp.status == 200:
                    resp.close()  # never read a whole shard we did not ask for
                    raise _bad_range(
                        f"{what}: answered 200 (whole file) instead of 206", "ignored_range", rid
                    )
                body = await resp.content.read(hh.MAX_BODY_SNIPPET)
                raise self._status_failure(resp, body, rid, what, on_resolve=False)
            _check_content_range(resp, start, end, size, what, rid)
            return await self._read_exact(resp, end - start, what, rid, consumer)

    async def _read_exact(
        self,
        resp: aiohttp.ClientResponse,
        length: int,
        what: str,
        rid: str | None,
        consumer: Consumer | None = None,
    ) -> bytearray:
        # A consumer gets aiohttp's own chunks: no zero-filled buffer, no copy into it.
        buf = bytearray(length if consumer is None else 0)
        pos = 0
        async for chunk in resp.content.iter_any():
            n = len(chunk)
            if pos + n > length:
                resp.close()
                raise _bad_range(
                    f"{what}: body longer than the {length} bytes asked", "long_body", rid
                )
            if consumer is None:
                buf[pos : pos + n] = chunk
            else:
                consumer.feed(chunk, pos)
            pos += n
        if pos != length:
            raise _bad_range(f"{what}: body ended after {pos} of {length} bytes", "truncated", rid)
        self.count("bytes", length)
        return buf

    def _status_failure(
        self,
        resp: aiohttp.ClientResponse,
        body: bytes,
        rid: str | None,
        what: str,
        *,
        on_resolve: bool,
    ) -> Exception:
        # A HEAD has no body: the Hub puts its message in X-Error-Message.
        message = resp.headers.get("X-Error-Message", "").encode() or body
        err = hh.error_for_status(resp.status, message, rid, what, on_resolve=on_resolve)
        if hh.is_retryable_status(resp.status):
            return Transient(err, f"status_{resp.status}", hh.server_wait(resp.headers))
        return err


def _bad_range(message: str, fault: str, rid: str | None) -> Transient:
    return Transient(errors.BadUpstreamRange(message, request_id=rid), fault)


def _check_content_range(
    resp: aiohttp.ClientResponse, start: int, end: int, size: int | None, what: str, rid: str | None
) -> None:
    got = hh.parse_content_range(resp.headers.get("Content-Range"))
    if got is None or got[:2] != (start, end) or (size is not None and got[2] != size):
        resp.close()
        raise _bad_range(
            f"{what}: Content-Range {resp.headers.get('Content-Range')!r} is not what was asked "
            f"(bytes {start}-{end - 1}/{size if size is not None else '*'})",
            "content_range",
            rid,
        )
    if resp.content_length is not None and resp.content_length != end - start:
        resp.close()
        raise _bad_range(
            f"{what}: Content-Length {resp.content_length} != {end - start}", "content_length", rid
        )


def _check_identity(headers: Any, manifest: Any, file: str, rid: str | None) -> None:
    commit = headers.get("X-Repo-Commit")
    if commit and commit != manifest.revision:
        raise errors.UpstreamError(
            f"resolve {file}: the Hub answered for commit {commit}, "
            f"not the pinned {manifest.revision}",
            request_id=rid,
        )
    info = manifest.files.get(file)
    linked = headers.get("X-Linked-Size")
    if info is not None and linked and linked.isdigit() and int(linked) != info.size:
        raise errors.BadUpstreamRange(
            f"resolve {file}: the Hub says {linked} bytes, the manifest {info.size}; "
            "this is not the pinned file",
            request_id=rid,
        )
    # The Hub's sha256 of an LFS file: a manifest that disagrees is refused for that file even
    # where its registration could not ask the Hub's metadata (an endpoint without that API).
    etag = (headers.get("X-Linked-Etag") or "").removeprefix("W/").strip('"').lower()
    if info is not None and _SHA256.fullmatch(etag) and etag != info.sha256:
        raise errors.ManifestMismatch(
            f"resolve {file}: sha256 {info.sha256} in the manifest of {manifest.repo}, {etag} "
            "on the Hub at that commit: the manifest was altered or not built from this commit; "
            "register a manifest built from it (cachecd manifest build)",
            request_id=rid,
        )
