"""HTTP details of talking to a Hub: status -> error, Content-Range, waits the server asks for,
backoff, signed-URL lifetimes, the proxy for a URL. Pure functions, no I/O, so each rule is
tested on its own.

Invariant: an error message built here never contains a request header (so never a token) and
never a signed URL's query string; it keeps the server's own message and X-Request-Id.
"""

from __future__ import annotations

import calendar
import email.utils
import random
import re
import time
from collections.abc import Mapping
from urllib.parse import parse_qs, urlsplit
from urllib.request import proxy_bypass_environment  # type: ignore[attr-defined]  # no stub

from cachecd import errors

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_RATELIMIT_T = re.compile(r"(?:^|[;,\s])t=(\d+)")
_RATELIMIT_R = re.compile(r"(?:^|[;,\s])r=(\d+)")
MAX_BODY_SNIPPET = 300


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``bytes S-E/SIZE`` -> (S, E exclusive, SIZE or None for ``*``); anything else -> None."""
    if value is None:
        return None
    m = _CONTENT_RANGE.fullmatch(value.strip())
    if m is None:
        return None
    size = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), int(m.group(2)) + 1, size


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def server_wait(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """The longest wait the server asked for: Retry-After, ``RateLimit: ...;t=N``, RateLimit-Reset."""
    waits: list[float] = []
    ra = parse_retry_after(headers.get("Retry-After"), now)
    if ra is not None:
        waits.append(ra)
    rl = headers.get("RateLimit")
    if rl:
        m = _RATELIMIT_T.search(rl)
        if m:
            waits.append(float(m.group(1)))
    reset = headers.get("RateLimit-Reset")
    if reset and reset.strip().isdigit():
        waits.append(float(reset.strip()))
    return max(waits) if waits else None


def quota_spent_wait(headers: Mapping[str, str]) -> float | None:
    """Seconds until the window resets when a success says none are left (``RateLimit:
    ...;r=0;t=N``): the next request would be refused, so it waits that long instead."""
    rl = headers.get("RateLimit")
    r = _RATELIMIT_R.search(rl) if rl else None
    t = _RATELIMIT_T.search(rl) if rl else None
    if r is None or t is None or int(r.group(1)) > 0:
        return None
    return float(t.group(1))


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Capped exponential backoff with full jitter (attempt counts from 0)."""
    ceiling = min(cap, base * (2 ** min(attempt, 30)))
    return (rng or random).uniform(0.0, ceiling)


def signed_url_expiry(url: str, now: float | None = None) -> float | None:
    """Wall-clock epoch at which a signed CDN URL stops working, when the URL says so."""
    query = {k.lower(): v[0] for k, v in parse_qs(urlsplit(url).query).items() if v}
    for key in ("expires", "exp", "x-expires"):
        if query.get(key, "").isdigit():
            return float(query[key])
    amz_date, amz_expires = query.get("x-amz-date"), query.get("x-amz-expires")
    if amz_date and amz_expires and amz_expires.isdigit():
        try:
            start = calendar.timegm(time.strptime(amz_date, "%Y%m%dT%H%M%SZ"))
        except ValueError:
            return None
        return start + float(amz_expires)
    return None


def describe(status: int, body: bytes, request_id: str | None, what: str) -> str:
    text = body[:MAX_BODY_SNIPPET].decode("utf-8", "replace").strip()
    rid = f" request_id={request_id}" if request_id else ""
    return f"{what}: HTTP {status}{rid}: {text or '(no message)'}"


def error_for_status(
    status: int, body: bytes, request_id: str | None, what: str, *, on_resolve: bool
) -> errors.CachecdError:
    """The typed error for a final (not retried, or retries exhausted) status."""
    msg = describe(status, body, request_id, what)
    if status == 401:
        return errors.Unauthorized(
            f"{msg}. Run `hf auth login` with a token that can read this repo: it counts from the "
            "next fetch, without a restart (an HF_TOKEN in the daemon's environment wins over "
            "it: change that and restart the daemon)",
            request_id=request_id,
        )
    if status == 403 and on_resolve:
        return errors.Gated(
            f"{msg}. Accept the model's terms on its Hub page with this account, then retry",
            request_id=request_id,
        )
    if status == 404:
        return errors.NotFound(
            f"{msg}. Check the repo, revision and file name", request_id=request_id
        )
    if status == 416:
        return errors.BadUpstreamRange(
            f"{msg}. The range lies outside the file", request_id=request_id
        )
    if status == 429:
        return errors.UpstreamRateLimited(
            f"{msg}. Rate limited; retry later", request_id=request_id
        )
    return errors.UpstreamError(msg, request_id=request_id)


def is_retryable_status(status: int) -> bool:
    return status == 429 or status == 408 or status >= 500


def proxy_for(url: str, proxies: Mapping[str, str]) -> str | None:
    """The proxy a request to ``url`` goes through, by the environment's rules (``proxies`` as
    ``urllib.request.getproxies_environment`` gives them): the scheme's proxy, else ``all``,
    unless ``no`` names the host (``*``, a host or domain suffix, optionally with a port).
    UpstreamError for a proxy that is not http(s):// (a SOCKS proxy): naming it beats a
    connection that silently bypasses it."""
    parts = urlsplit(url)
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    host = parts.netloc.rpartition("@")[2]
    if not proxy or proxy_bypass_environment(host, dict(proxies)):
        return None
    if "://" not in proxy:
        proxy = "http://" + proxy  # curl's reading of a bare host:port
    scheme = proxy.split("://", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise errors.UpstreamError(
            f"the environment's proxy for {parts.scheme}:// URLs is a {scheme}:// proxy, which "
            "cachecd cannot use: set HTTPS_PROXY/HTTP_PROXY to an http:// proxy, or name the Hub's "
            "hosts in NO_PROXY, and restart the daemon"
        )
    return proxy
