"""The hub's Xet side, as the Hub and its content store (CAS) answer (hub-docs ``docs/xet/``:
auth, api, download-protocol).

- ``GET /api/{models,datasets}/ORG/NAME/xet-read-token/REV``: a CAS token for the repo,
  ``{"accessToken", "exp", "casUrl"}`` in the body (what hf_xet's refresh reads) and as the
  ``X-Xet-Cas-Url``, ``X-Xet-Access-Token``, ``X-Xet-Token-Expiration`` headers (what
  huggingface_hub reads). The hub's own token, if it has one, is needed to get one.
- ``{casUrl}/v2/reconstructions/HASH`` (and ``/v1/``) with an optional ``Range: bytes=a-b``:
  the terms and, per xorb, signed URLs of the exact byte ranges; ``{casUrl}/v2/file-chunk-hashes/
  HASH`` with ``X-Range-Dirty``: the proof windows and gap trees (``cachecd.xet.proof``).
  Every CAS call needs ``Authorization: Bearer <accessToken>``; an expired or foreign token is 401.
- ``/_xorb/HASH?X-Xet-Signed-Range=...&Expires=...&Signature=...``: the signed xorb ranges, 206
  with the exact range asked (which must lie within the signed one), 403 once expired or for any
  other range. No token: the signature is the authority, as on the Hub's transfer host.

Invariants: the CAS routes read only what ``XetStore`` built (a hash is 64 hex digits before it
names a path); building and reading run in threads; tokens and signatures are HMACs under a
secret that lives as long as the process, and no token is logged.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from typing import Any
from urllib.parse import quote

from aiohttp import web
from aiohttp.web_response import StreamResponse

from cachecd.lanhub.answers import bad_request, hf_error
from cachecd.lanhub.repo import RepoFile, RepoSnapshot
from cachecd.lanhub.xet_faults import XetFaults
from cachecd.lanhub.xet_store import XetFile, XetStore
from cachecd.xet import hashing, proof, xorb

log = logging.getLogger("cachecd.lanhub.server")

DEFAULT_TOKEN_TTL_S = 3600.0
DEFAULT_XORB_URL_TTL_S = 3600.0
CAS_PREFIX = "/_xet"
XORB_PREFIX = "/_xorb"
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class XetSide:
    """Token, CAS and xorb handlers over one ``XetStore``."""

    def __init__(self, store: XetStore, *, token_ttl_s: float = DEFAULT_TOKEN_TTL_S,
                 url_ttl_s: float = DEFAULT_XORB_URL_TTL_S) -> None:
        self.store = store
        self.token_ttl_s = token_ttl_s
        self.url_ttl_s = url_ttl_s
        self.faults = XetFaults()
        self._secret = secrets.token_bytes(32)

    def annotate(self, snap: RepoSnapshot) -> RepoSnapshot:
        """``snap`` with each large (LFS) file's xet hash, built the first time (blocking)."""
        files = {}
        for path, f in snap.files.items():
            if f.git_oid is None and f.size > 0 and f.xet_hash is None:
                try:
                    f = dataclasses.replace(
                        f, xet_hash=self.store.xet_hash(f.real, f.sha256, f.size))
                except OSError as exc:  # served by the LFS route alone until a build succeeds
                    log.warning("xet build failed file=%s error=%s: LFS route only", path, exc)
            files[path] = f
        return dataclasses.replace(snap, files=files)

    @staticmethod
    def file_headers(request: web.Request, snap: RepoSnapshot, f: RepoFile) -> dict[str, str]:
        """What ``/resolve`` (and its same-host redirect) adds for a file stored with Xet: its
        hash and where a CAS token for this commit is had (huggingface_hub reads either the
        ``Link`` or the header)."""
        if f.xet_hash is None:
            return {}
        kind = "datasets" if request.match_info.get("kind") else "models"
        route = f"{request.url.origin()}/api/{kind}/{snap.repo_id}/xet-read-token/{snap.commit}"
        return {"X-Xet-Hash": f.xet_hash, "X-Xet-Refresh-Route": route,
                "Link": f'<{route}>; rel="xet-auth"'}

    # ------------------------------------------------------------ tokens

    def _mac(self, *parts: str) -> str:
        return hmac.new(self._secret, "\n".join(parts).encode(), hashlib.sha256).hexdigest()

    def issue(self, repo_key: str, commit: str) -> tuple[str, int]:
        ttl = -1.0 if self.faults.fire("expired_token") else self.token_ttl_s
        exp = int(time.time() + ttl)
        claim = base64.urlsafe_b64encode(json.dumps([repo_key, commit, exp]).encode()).decode()
        return f"xet_{claim}.{self._mac('token', claim)}", exp

    def check_token(self, request: web.Request) -> None:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ")
        claim, _, sig = given.removeprefix("xet_").partition(".")
        ok = given.startswith("xet_") and hmac.compare_digest(sig, self._mac("token", claim))
        try:
            exp = int(json.loads(base64.urlsafe_b64decode(claim))[2]) if ok else 0
        except (ValueError, IndexError, TypeError):
            exp = 0
        if exp <= time.time():
            self.faults.counts["token_refused"] += 1
            raise hf_error(web.HTTPUnauthorized, None,
                           "Xet token missing, invalid or expired: ask xet-read-token again")

    def token_answer(self, request: web.Request, repo_key: str, commit: str) -> web.Response:
        self.faults.counts["token"] += 1
        token, exp = self.issue(repo_key, commit)
        cas = f"{request.url.origin()}{CAS_PREFIX}"
        headers = {"X-Xet-Cas-Url": cas, "X-Xet-Access-Token": token,
                   "X-Xet-Token-Expiration": str(exp)}
        return web.json_response({"accessToken": token, "exp": exp, "casUrl": cas},
                                 headers=headers)

    # ------------------------------------------------------------ CAS

    async def _file(self, request: web.Request) -> XetFile:
        self.check_token(request)
        name = request.match_info["hash"]
        if not _HEX64.fullmatch(name):
            raise bad_request(f"not a xet file hash: {name[:80]!r}")
        found = await asyncio.to_thread(self.store.load, name)
        if found is None:
            raise hf_error(web.HTTPNotFound, None, f"no file with xet hash {name} here")
        return found

    async def reconstruction(self, request: web.Request) -> StreamResponse:
        version = request.match_info["v"]
        self.faults.counts[f"reconstruction_{version}"] += 1
        f = await self._file(request)
        first, last = _byte_range(request.headers.get("Range"), f.size)
        pieces = _pieces(f, first, last)
        if len(pieces) >= 2 and self.faults.fire("swap_xorb"):
            pieces[0], pieces[1] = pieces[1], pieces[0]
        origin = str(request.url.origin())
        ttl = -1.0 if self.faults.fire("expired_url") else self.url_ttl_s
        terms: list[dict[str, Any]] = []
        fetch: dict[tuple[str, int, int], tuple[int, int]] = {}
        for span, a, b in pieces:
            terms.append({"hash": span.hash, "unpacked_length": f.starts[span.first + b]
                          - f.starts[span.first + a], "range": {"start": a, "end": b}})
            fetch.setdefault((span.hash, a, b), (span.offsets[a], span.offsets[b] - 1))
        body: dict[str, Any] = {"offset_into_first_range": first - f.starts[f.chunk_at(first)],
                                "terms": terms}
        entries: dict[str, list[dict[str, Any]]] = {}
        for (name, a, b), (lo, hi) in fetch.items():
            url = self.sign(origin, name, lo, hi, ttl)
            if version == "v2":
                entries.setdefault(name, []).append({"url": url, "ranges": [
                    {"chunks": {"start": a, "end": b}, "bytes": {"start": lo, "end": hi}}]})
            else:
                entries.setdefault(name, []).append({"range": {"start": a, "end": b}, "url": url,
                                                     "url_range": {"start": lo, "end": hi}})
        body["xorbs" if version == "v2" else "fetch_info"] = entries
        return web.json_response(body)

    async def chunk_hashes(self, request: web.Request) -> StreamResponse:
        self.faults.counts["chunk_hashes"] += 1
        f = await self._file(request)
        ranges = _dirty_ranges(request.headers.get("X-Range-Dirty"))
        shift = self.faults.proof_offset if self.faults.fire("proof_offset") else 0
        ranges = [(max(0, a + shift), max(0, b + shift)) for a, b in ranges]
        try:
            answer = await asyncio.to_thread(proof.build_answer, f.leaves, f.size, ranges)
        except ValueError as exc:
            raise bad_request(f"X-Range-Dirty: {exc}") from exc
        if self.faults.fire("proof_node_flip"):
            _flip_node(answer)
        return web.json_response(answer)

    # ------------------------------------------------------------ signed xorb ranges

    def sign(self, origin: str, name: str, lo: int, hi: int, ttl: float) -> str:
        signed = f"bytes={lo}-{hi}"
        expires = str(int(time.time() + ttl))
        sig = self._mac("xorb", name, signed, expires)
        return (f"{origin}{XORB_PREFIX}/{name}?X-Xet-Signed-Range={quote(signed, safe='')}"
                f"&Expires={expires}&Signature={sig}")

    async def xorb(self, request: web.Request) -> StreamResponse:
        self.faults.counts["xorb"] += 1
        name, query = request.match_info["hash"], request.rel_url.query
        signed, expires = query.get("X-Xet-Signed-Range", ""), query.get("Expires", "")
        valid = hmac.compare_digest(self._mac("xorb", name, signed, expires),
                                    query.get("Signature", ""))
        if not valid or not expires.isdigit() or int(expires) < time.time():
            self.faults.counts["xorb_expired"] += 1
            raise hf_error(web.HTTPForbidden, None,
                           "Signed xorb URL is invalid or expired: ask for the reconstruction again")
        lo, hi = _signed_bounds(signed)
        want = _RANGE.match(request.headers.get("Range", signed))
        a = int(want.group(1)) if want else -1
        b = int(want.group(2)) if want and want.group(2) else hi
        if not (lo <= a <= b <= hi):
            raise hf_error(web.HTTPForbidden, None, f"Range outside the signed {signed}")
        path = self.store.xorb_path(name)
        if path is None:
            raise hf_error(web.HTTPNotFound, None, f"no xorb {name} here")
        body = await asyncio.to_thread(_read, path, a, b - a + 1)
        if len(body) != b - a + 1:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{lo}"})
        body = self._spoil(body)
        size = path.stat().st_size
        return web.Response(status=206, body=body, content_type="application/octet-stream",
                            headers={"Content-Range": f"bytes {a}-{b}/{size}"})

    def _spoil(self, body: bytes) -> bytes:
        out = bytearray(body)
        if len(out) > xorb.HEADER and self.faults.fire("flip_xorb_byte"):
            payload = int.from_bytes(out[1:4], "little")
            out[min(len(out) - 1, xorb.HEADER + payload // 2)] ^= 0x01
        if len(out) >= xorb.HEADER and self.faults.fire("bad_chunk_header"):
            size = int.from_bytes(out[5:8], "little")
            out[5:8] = ((size + 1) % (1 << 24)).to_bytes(3, "little")
        return bytes(out)


def _read(path: Any, offset: int, length: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(length)


def _pieces(f: XetFile, first: int, last: int) -> list[tuple[Any, int, int]]:
    """(xorb span, first chunk, end chunk) in the xorb, for the chunks holding [first, last]."""
    c0, c1 = f.chunk_at(first), f.chunk_at(last) + 1
    out = []
    for span in f.xorbs:
        a, b = max(c0, span.first), min(c1, span.first + span.count)
        if a < b:
            out.append((span, a - span.first, b - span.first))
    return out


def _byte_range(header: str | None, size: int) -> tuple[int, int]:
    if header is None:
        return 0, size - 1
    m = _RANGE.match(header.strip())
    if m is None:
        raise bad_request(f"Range must be bytes=START-END, got {header[:80]!r}")
    start = int(m.group(1))
    end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
    if start >= size or end < start:
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
    return start, end


def _dirty_ranges(header: str | None) -> list[tuple[int, int]]:
    """``bytes=a-b,c-d`` (inclusive ends) as ``[(a, b + 1), ...]``."""
    if not header or not header.strip().startswith("bytes="):
        raise bad_request("X-Range-Dirty is required: bytes=START-END[,START-END...]")
    out = []
    for part in header.strip()[len("bytes="):].split(","):
        lo, dash, hi = part.strip().partition("-")
        if not (dash and lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise bad_request(f"X-Range-Dirty: malformed range {part.strip()[:40]!r}")
        out.append((int(lo), int(hi) + 1))
    return out


def _signed_bounds(signed: str) -> tuple[int, int]:
    m = _RANGE.match(signed)
    if m is None or not m.group(2):
        raise hf_error(web.HTTPForbidden, None, "Signed xorb URL without a signed range")
    return int(m.group(1)), int(m.group(2))


def _flip_node(answer: dict[str, Any]) -> None:
    for tree in answer["hashRanges"]:
        if tree and tree["nodes"]:
            raw = bytearray(hashing.from_hex(tree["nodes"][0]["hash"]))
            raw[0] ^= 0x01
            tree["nodes"][0]["hash"] = hashing.to_hex(bytes(raw))
            return
