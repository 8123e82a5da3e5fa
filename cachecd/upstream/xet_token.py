"""Xet read tokens: one per (repo, revision), asked of the Hub with the Hub token, kept until
shortly before ``exp`` and asked again then, before a request could be refused.

Invariants:
- A token is handed out only while it has more than its margin left: 30 s (the spec's advice),
  or a quarter of its life when it lives less than two minutes, so a short-lived token is still
  used rather than asked for at every request.
- Concurrent askers of one (repo, revision) share one request (``SingleFlight``).
- ``refused(token)`` (the content store answered 401) drops that token only: a newer one another
  request already fetched stays.
- The Hub token goes to the endpoint's token route only; the Xet token goes to the content store
  only. Neither is logged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from huggingface_hub.utils._xet import (
    XetTokenType,
    parse_xet_connection_info_from_headers,
    xet_connection_info_refresh_url,
)

from cachecd import errors
from cachecd.upstream import hub_http as hh
from cachecd.upstream.hub_auth import HubAuth
from cachecd.upstream.retry import Transient
from cachecd.upstream.singleflight import SingleFlight
from cachecd.upstream.xet_wire import Token, WireError, parse_token

log = logging.getLogger(__name__)

REFRESH_MARGIN_S = 30.0
MAX_TOKEN_ANSWER = 1 << 20

# (url, once) -> the answer: the caller's Retrier with its parallel limit and waits.
Run = Callable[[str, Callable[[], Awaitable[Any]], str], Awaitable[Any]]


def margin(token: Token, issued: float) -> float:
    """Seconds before ``exp`` at which ``token`` is asked for again."""
    return min(REFRESH_MARGIN_S, max(0.0, token.exp - issued) / 4)


class XetTokens:
    """Read tokens of ``endpoint``'s repos; ``session()`` gives the HTTP session, ``run`` sends
    each request through the source's Retrier."""

    def __init__(self, endpoint: str, auth: HubAuth,
                 session: Callable[[], aiohttp.ClientSession], run: Run,
                 proxy: Callable[[str], str | None], timeout: aiohttp.ClientTimeout) -> None:
        self.endpoint = endpoint
        self._auth, self._session, self._run, self._proxy = auth, session, run, proxy
        self._timeout = timeout
        self._tokens: dict[tuple[str, str], tuple[Token, float]] = {}  # -> (token, refresh at)
        self._asking: SingleFlight[tuple[str, str], tuple[Token, float]] = SingleFlight()
        self.requests = 0

    async def get(self, repo: str, revision: str) -> Token:
        """A token with more than its margin left for ``repo`` at ``revision``."""
        key = (repo, revision)
        held = self._tokens.get(key)
        if held is not None and time.time() < held[1]:
            return held[0]
        got = await self._asking.do(key, lambda: self._ask(repo, revision))
        self._tokens[key] = got
        return got[0]

    def refused(self, repo: str, revision: str, token: Token) -> None:
        """The content store refused ``token`` (expired early, revoked): ask again next time."""
        held = self._tokens.get((repo, revision))
        if held is not None and held[0] is token:
            del self._tokens[(repo, revision)]

    async def _ask(self, repo: str, revision: str) -> tuple[Token, float]:
        url = xet_connection_info_refresh_url(token_type=XetTokenType.READ, repo_id=repo,
                                              repo_type="model", revision=revision,
                                              endpoint=self.endpoint)
        await self._auth.refresh()
        try:
            token = await self._run(url, lambda: self._once(url, repo, revision), "xet_token")
        except errors.Unauthorized:
            if not await self._auth.refresh():  # a token that changed while this one was refused
                raise
            token = await self._run(url, lambda: self._once(url, repo, revision), "xet_token")
        now = time.time()
        log.debug("event=xet_token repo=%s revision=%s expires_in_s=%.0f", repo, revision[:12],
                  token.exp - now)
        return token, token.exp - margin(token, now)

    async def _once(self, url: str, repo: str, revision: str) -> Token:
        self.requests += 1
        headers = {**self._auth.headers, "Accept-Encoding": "identity"}
        async with self._session().get(url, headers=headers, allow_redirects=False,
                                       timeout=self._timeout, proxy=self._proxy(url)) as resp:
            body = await resp.content.read(MAX_TOKEN_ANSWER + 1)
            rid = resp.headers.get("X-Request-Id")
            what = f"xet read token for {repo}@{revision[:12]}"
            if resp.status != 200:
                message = resp.headers.get("X-Error-Message", "").encode() or body
                err = hh.error_for_status(resp.status, message, rid, what, on_resolve=True)
                if hh.is_retryable_status(resp.status):
                    raise Transient(err, f"xet_token_{resp.status}", hh.server_wait(resp.headers))
                raise err
            return _token_of(body, resp.headers, what, rid)


def _token_of(body: bytes, headers: Any, what: str, rid: str | None) -> Token:
    """The spec's JSON answer, else the headers huggingface_hub reads (X-Xet-Access-Token...)."""
    try:
        if len(body) > MAX_TOKEN_ANSWER:
            raise WireError("answer over 1 MiB")
        return parse_token(json.loads(body))
    except (ValueError, WireError) as exc:
        info = parse_xet_connection_info_from_headers(headers)
        if info is None:
            raise errors.UpstreamError(f"{what}: the endpoint's answer is not a token ({exc})",
                                       request_id=rid) from None
        return Token(info.access_token, info.endpoint.rstrip("/"),
                     float(info.expiration_unix_epoch))
