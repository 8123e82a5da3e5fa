"""Answers from outside read within bounds before anything decodes them, and redirects checked
before they are followed: the one way every synchronous read of an endpoint goes (a shard's
first bytes, the Hub's metadata, a small file, ``plan``'s config).

Invariants:
- A body is streamed raw (``iter_raw``) into at most ``cap`` bytes; a ``Content-Encoding`` of
  gzip or deflate is inflated here, at most ``cap`` bytes out (``zlib``'s ``max_length``), so a
  gzip bomb stops at the cap having inflated no more than it; any other encoding is refused.
  The whole read is bounded in time too (``deadline_s``): a body that trickles a byte at a time
  just inside the read timeout is cut there.
- JSON is checked for size and depth before ``json.loads`` (``bounds.loads``), so a
  200,000-deep answer is an error naming the endpoint, never a ``RecursionError``.
- A redirect goes only to http(s), and never to a loopback or link-local host (a cloud's
  metadata service at 169.254.169.254) unless the endpoint itself is one such host.
- Every refusal is ``UpstreamAnswerInvalid`` or ``RedirectRefused``, one line naming what was
  asked and what to do.
"""

from __future__ import annotations

import ipaddress
import time
import zlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from cachecd import constants, errors
from cachecd.manifest import bounds

METADATA_BYTES = 16 << 20  # the Hub's model_info of K3, every file listed, is ~50 KB
SMALL_FILE_BYTES = 16 << 20  # config.json and its kind: a few KB
REDIRECTS = (301, 302, 303, 307, 308)
MAX_HOPS = 3
_RAW_CHUNK = 64 << 10
_WHAT_TO_DO = "try again later, or another endpoint (--endpoint / HF_ENDPOINT)"


SMALL_ANSWER_S = 60.0  # a small answer's whole read, however it trickles


@dataclass
class Answer:
    status: int
    headers: Any  # the response's headers (case-insensitive)
    body: bytes
    url: str  # where it came from, after the redirects followed
    response: Any = None  # the streamed response it was read from (its type and request)


def read_body(resp: Any, cap: int, what: str, deadline_s: float = constants.TOTAL_TIMEOUT_S
              ) -> bytes:
    """At most ``cap`` bytes of a streamed httpx response, inflated here if it is compressed
    (module docstring); ``UpstreamAnswerInvalid`` past the cap, the deadline or an encoding
    cachecd does not read."""
    inflate = _inflater(resp.headers.get("Content-Encoding", ""), what)
    out = bytearray()
    ends = time.monotonic() + deadline_s
    for raw in resp.iter_raw(_RAW_CHUNK):
        if inflate is None:
            out += raw
        else:
            try:
                out += inflate.decompress(raw, cap + 1 - len(out))
            except zlib.error as exc:
                raise _invalid(what, f"its compressed body is corrupt ({exc})") from None
            if inflate.unconsumed_tail:
                out += b"\0"  # more was left: over the cap
        if len(out) > cap:
            raise _invalid(what, f"its body is over the {cap}-byte limit"
                                 f"{' once decompressed' if inflate is not None else ''}")
        if time.monotonic() > ends:
            raise _invalid(what, f"its body took over {deadline_s:.0f}s")
    return bytes(out)


def _inflater(encoding: str, what: str) -> Any:
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return zlib.decompressobj()
    raise _invalid(what, f"it came with Content-Encoding {encoding!r}, which cachecd does not read")


def get(session: Any, url: str, headers: dict[str, str], *, cap: int, what: str,
        endpoint: str, timeout: float = constants.READ_TIMEOUT_S,
        follow: bool = False, plain: dict[str, str] | None = None,
        deadline_s: float = SMALL_ANSWER_S) -> Answer:
    """One GET through ``session`` (huggingface_hub's httpx client), its body within ``cap``;
    ``follow``: up to ``MAX_HOPS`` redirects, each checked (``check_redirect``), with ``plain``
    headers (no token) once it has left the endpoint's origin."""
    for _ in range(MAX_HOPS + 1):
        with session.stream("GET", url, headers=headers, follow_redirects=False,
                            timeout=timeout) as resp:
            location = resp.headers.get("Location")
            if not (follow and resp.status_code in REDIRECTS and location):
                body = read_body(resp, cap, what, deadline_s)
                return Answer(resp.status_code, resp.headers, body, url, resp)
        url = check_redirect(endpoint, urljoin(url, location), what)
        if not _same_origin(url, endpoint) and plain is not None:
            headers = plain
    raise _invalid(what, f"it redirected more than {MAX_HOPS} times")


def as_response(answer: Answer) -> Any:
    """``answer`` as a response of its client's type already read (for huggingface_hub's
    ``hf_raise_for_status``), without the encoding headers its body no longer has."""
    keep = [(k, v) for k, v in answer.headers.multi_items()
            if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
    return type(answer.response)(answer.status, headers=keep, content=answer.body,
                                 request=answer.response.request)


def json_answer(answer: Answer, what: str, max_bytes: int = METADATA_BYTES) -> Any:
    """An answer's JSON within ``bounds`` (size, depth, UTF-8), else ``UpstreamAnswerInvalid``."""
    try:
        return bounds.loads(answer.body, what, "answer", max_bytes)
    except errors.ManifestInvalid as exc:
        raise _invalid(what, f"its answer is not JSON cachecd reads ({exc.message})") from None


def check_redirect(endpoint: str, target: str, what: str) -> str:
    """``target`` if a redirect from ``endpoint`` may go there (module docstring), else
    ``RedirectRefused``."""
    parts = urlsplit(target)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise errors.RedirectRefused(
            f"{what}: {_origin(endpoint)} redirected to a {parts.scheme or 'relative'}:// URL, "
            f"which cachecd does not follow; {_WHAT_TO_DO}")
    kind = host_kind(parts.hostname)
    if kind and host_kind(urlsplit(endpoint).hostname or "") != kind:
        raise errors.RedirectRefused(
            f"{what}: {_origin(endpoint)} redirected to {parts.hostname}, a {kind} address, "
            f"which cachecd follows only from an endpoint that is one; {_WHAT_TO_DO}")
    return target


def host_kind(host: str) -> str:
    """"loopback", "link-local" or "" for any other host (a name is taken at its word, but
    ``localhost`` is loopback)."""
    if host.lower().rstrip(".") in ("localhost", "localhost.localdomain") or host.lower(
            ).endswith(".localhost"):
        return "loopback"
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback or ip.is_unspecified:
        return "loopback"
    return "link-local" if ip.is_link_local else ""


def _same_origin(url: str, base: str) -> bool:
    a, b = urlsplit(url), urlsplit(base)
    return (a.scheme, a.netloc) == (b.scheme, b.netloc)


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _invalid(what: str, why: str) -> errors.UpstreamAnswerInvalid:
    return errors.UpstreamAnswerInvalid(f"{what}: {why}; {_WHAT_TO_DO}")
