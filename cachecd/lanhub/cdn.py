"""What a signed ``/_cdn`` URL rests on: the HMAC signer with its expiry, the exact file response
(one range, no compressed sibling, a fixed ETag), and the conditional-request checks.

Invariants:
- A URL is valid only with the signature over (resource, expiry) and before that expiry; the
  secret lives as long as the process.
- A file is served only while its size and mtime are those it was listed with.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from cachecd.lanhub.repo import RepoFile

DEFAULT_URL_TTL_S = 3600.0
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$", re.IGNORECASE | re.ASCII)


# ---------------------------------------------------------------- signed CDN urls


class UrlSigner:
    """HMAC-SHA256 over (resource, expiry) with a secret that lives as long as the process."""

    def __init__(self, ttl_s: float = DEFAULT_URL_TTL_S, secret: bytes | None = None) -> None:
        self.ttl_s = ttl_s
        self._secret = secret or secrets.token_bytes(32)

    def _mac(self, resource: str, expires: str) -> str:
        msg = f"{resource}\n{expires}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def query(self, resource: str) -> str:
        expires = str(int(time.time() + self.ttl_s))
        return f"expires={expires}&sig={self._mac(resource, expires)}"

    def valid(self, resource: str, expires: str, sig: str) -> bool:
        if not expires.isdigit() or int(expires) < time.time():
            return False
        return hmac.compare_digest(self._mac(resource, expires), sig)


# ---------------------------------------------------------------- the file response


class ExactFileResponse(web.FileResponse):
    """aiohttp's FileResponse (Range, sendfile) minus its swap to a ``.gz``/``.br`` sibling:
    a repo may hold ``x`` and ``x.gz`` as two different files. With ``etag``, that is the ETag
    (a git blob id, as the Hub sends for a file kept in git), not aiohttp's mtime-size tag."""

    def __init__(self, path: Path, etag: str | None = None) -> None:
        self._fixed_etag = etag
        super().__init__(path)

    def _get_file_path_stat_encoding(self, accept_encoding: str) -> Any:
        return super()._get_file_path_stat_encoding("")

    @property
    def etag(self) -> Any:
        return web.FileResponse.etag.fget(self)  # type: ignore[attr-defined]

    @etag.setter
    def etag(self, value: Any) -> None:
        web.FileResponse.etag.fset(self, self._fixed_etag or value)  # type: ignore[attr-defined]


def unsatisfiable(range_header: str | None, size: int) -> bool:
    """Ranges aiohttp would serve but RFC 9110 calls unsatisfiable (``bytes=-0``, empty file)."""
    if range_header is None:
        return False
    m = _RANGE_RE.match(range_header.strip())
    if m is None:
        return True
    start, end = m.groups()
    if not start:
        return not end or int(end) == 0 or size == 0
    return int(start) >= size or (end != "" and int(end) < int(start))


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    """RFC 9110's weak comparison of ``If-None-Match`` with the ETag the answer would carry."""
    if not if_none_match:
        return False
    given = [t.strip().removeprefix("W/") for t in if_none_match.split(",")]
    return "*" in given or etag.removeprefix("W/") in given


def unchanged(f: RepoFile) -> bool:
    try:
        st = f.real.stat()
    except OSError:
        return False
    return (st.st_size, st.st_mtime_ns) == (f.size, f.mtime_ns)
