"""XetFakeHub: FakeHub that also keeps its files in Xet, as the Hub does, with tamper knobs.

Each file is cut by the real chunker (``cachecd.xet.chunking``), hashed (``cachecd.xet.hashing``)
and packed into small xorbs (``chunks_per_xorb``, so a window spans several), and the endpoint
answers what a client of the Hub's content store asks: ``X-Xet-Hash`` on ``/resolve``'s 302, the
read token route, ``/v2/reconstructions`` (``/v1`` too) with ``Range``, signed xorb URLs that
expire (one range: 206; several: ``multipart/byteranges``), and ``/v2/file-chunk-hashes`` with
``X-Range-Dirty`` (``cachecd.xet.proof.build_answer``). The content store lives on the same
host and port (``casUrl`` is the hub's own URL).

``xet_faults`` (``XetFaults``) tampers with answers; every request is recorded as FakeHub's are
(kinds ``xet_token``, ``xet_proof``, ``xet_reconstruction``, ``xet_xorb``).
"""

from __future__ import annotations

import bisect
import hmac
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import MultipartWriter, web

from cachecd.xet import chunking, hashing, proof, xorb
from tests.fakes.fake_hub import FakeHub


@dataclass
class XetFaults:
    """Tampering, each on every answer of its kind (a test turns it off to see recovery)."""

    flip_xorb_byte: bool = False  # one byte of a chunk's payload, in every xorb range served
    bad_chunk_header: bool = False  # the first chunk header's stored size, off by one
    proof_node: bool = False  # one node hash of a gap tree changed
    proof_offset: bool = False  # the gap trees of another range's proof, under the asked window
    swap_terms: bool = False  # the first two terms' xorbs and chunks exchanged
    expire_urls: int = 0  # the next N xorb GETs answer 403, as an expired signature does
    expire_tokens_after_proof: int = 0  # after the next N proofs, every token issued expires
    no_v2: bool = False  # /v2/reconstructions answers 404 (an older content store)
    token_ttl: float = 3600.0
    token_grace: float = 0.0  # the store still takes a token this long past its exp
    status_script: list[int] = field(default_factory=list)  # popped per proof/reconstruction
    retry_after: str | None = None  # sent with a scripted 429 or 503


@dataclass
class XetFile:
    hash: str
    size: int
    leaves: list[tuple[bytes, int]]
    starts: list[int]  # each chunk's first byte in the file
    places: list[tuple[str, int]]  # each chunk's (xorb, index in it)


@dataclass
class Xorb:
    data: bytes
    offsets: list[int]  # chunk i's header at offsets[i]; offsets[-1] the end


@dataclass
class XetStore:
    files: dict[str, XetFile] = field(default_factory=dict)
    xorbs: dict[str, Xorb] = field(default_factory=dict)

    def add(self, name: str, data: bytes, chunks_per_xorb: int) -> XetFile:
        ends = chunking.cut_points(data)
        leaves = hashing.hash_chunks(data, ends)
        starts = [0, *ends[:-1]]
        places: list[tuple[str, int]] = []
        for at in range(0, len(leaves), chunks_per_xorb):
            builder = xorb.XorbBuilder()
            for i in range(at, min(at + chunks_per_xorb, len(leaves))):
                builder.add(data[starts[i]:ends[i]], leaves[i])
            key = hashing.to_hex(builder.hash())
            self.xorbs[key] = Xorb(builder.serialize(), builder.offsets)
            places += [(key, k) for k in range(len(builder.leaves))]
        f = XetFile(hashing.to_hex(hashing.file_hash(leaves)), len(data), leaves, starts, places)
        self.files[f.hash] = f
        return f


class XetFakeHub(FakeHub):
    chunks_per_xorb = 3

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.xet_faults = XetFaults()
        self.store = XetStore()
        self._by_name: dict[str, XetFile] = {}
        self._tokens: dict[str, float] = {}

    def add_routes(self, app: web.Application) -> None:
        router = app.router
        router.add_get("/api/models/{org}/{name}/xet-read-token/{rev}", self._token)
        router.add_get("/v2/file-chunk-hashes/{hash}", self._proof)
        router.add_get("/{v:v[12]}/reconstructions/{hash}", self._reconstruction)
        router.add_get("/xorb/{hash}", self._xorb)

    def xet_file(self, name: str) -> XetFile:
        if name not in self._by_name:
            self._by_name[name] = self.store.add(name, (self.folder / name).read_bytes(),
                                                 self.chunks_per_xorb)
        return self._by_name[name]

    def expire_tokens(self) -> None:
        self._tokens = dict.fromkeys(self._tokens, -1e12)

    # -- the Hub's side ----------------------------------------------------------------------
    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        resp = await super()._resolve(request)
        if resp.status == 302:
            resp.headers["X-Xet-Hash"] = self.xet_file(request.match_info["file"]).hash
        return resp

    async def _token(self, request: web.Request) -> web.StreamResponse:
        self._record(request, "xet_token", 200)
        token = "xet_" + secrets.token_hex(12)
        self._tokens[token] = exp = time.time() + self.xet_faults.token_ttl
        return web.json_response({"accessToken": token, "exp": exp, "casUrl": self.url})

    # -- the content store -------------------------------------------------------------------
    def _scripted(self, request: web.Request, kind: str) -> web.Response | None:
        x = self.xet_faults
        status = x.status_script.pop(0) if x.status_script else 0
        if not status:
            return None
        self._record(request, kind, status)
        headers = {"Retry-After": x.retry_after} if x.retry_after and status in (429, 503) else {}
        return web.Response(status=status, headers=headers)

    def _authorized(self, request: web.Request) -> bool:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        exp = self._tokens.get(token)
        return exp is not None and exp + self.xet_faults.token_grace > time.time()

    def _file_of(self, request: web.Request) -> XetFile | None:
        return self.store.files.get(request.match_info["hash"])

    async def _proof(self, request: web.Request) -> web.StreamResponse:
        if (scripted := self._scripted(request, "xet_proof")) is not None:
            return scripted
        f, ok = self._file_of(request), self._authorized(request)
        status = 401 if not ok else 404 if f is None else 200
        self._record(request, "xet_proof", status)
        if status != 200:
            return web.Response(status=status)
        assert f is not None
        a, b = (int(v) for v in request.headers["X-Range-Dirty"].removeprefix("bytes=").split("-"))
        answer = proof.build_answer(f.leaves, f.size, (a, b + 1))
        x = self.xet_faults
        if x.proof_node:
            gap = next(g for g in answer["hashRanges"] if g)
            h = gap["nodes"][0]["hash"]
            gap["nodes"][0]["hash"] = ("0" if h[0] != "0" else "1") + h[1:]
        if x.proof_offset:
            shift = answer["windows"][0]["dirtyByteRange"][1] - a
            far = min(f.size - (b + 1 - a), a + shift) if a + shift < f.size else max(0, a - shift)
            other = proof.build_answer(f.leaves, f.size, (far, far + b + 1 - a))
            answer["hashRanges"] = other["hashRanges"]
        if x.expire_tokens_after_proof:
            x.expire_tokens_after_proof -= 1
            self.expire_tokens()
        return web.json_response(answer)

    async def _reconstruction(self, request: web.Request) -> web.StreamResponse:
        if (scripted := self._scripted(request, "xet_reconstruction")) is not None:
            return scripted
        f, ok = self._file_of(request), self._authorized(request)
        v1 = request.match_info["v"] == "v1"
        status = (401 if not ok else 404 if f is None or (self.xet_faults.no_v2 and not v1)
                  else 200)
        self._record(request, "xet_reconstruction", status)
        if status != 200:
            return web.Response(status=status)
        assert f is not None
        spec = request.headers.get("Range", f"bytes=0-{f.size - 1}").removeprefix("bytes=")
        a, b = (int(v) for v in spec.split("-"))
        return web.json_response(self._plan(f, a, min(b + 1, f.size), v1))

    def _plan(self, f: XetFile, a: int, b: int, v1: bool) -> dict[str, Any]:
        first, last = bisect.bisect_right(f.starts, a) - 1, bisect.bisect_left(f.starts, b)
        terms: list[dict[str, Any]] = []
        for i in range(first, last):
            key, k = f.places[i]
            size = f.leaves[i][1]
            if terms and terms[-1]["hash"] == key and terms[-1]["range"]["end"] == k:
                terms[-1]["range"]["end"] = k + 1
                terms[-1]["unpacked_length"] += size
            else:
                terms.append({"hash": key, "unpacked_length": size,
                              "range": {"start": k, "end": k + 1}})
        if self.xet_faults.swap_terms and len(terms) > 1:
            terms[0], terms[1] = terms[1], terms[0]
        fetch = {t["hash"]: self._fetch(t["hash"], t["range"]["start"], t["range"]["end"], v1)
                 for t in terms}
        key = "fetch_info" if v1 else "xorbs"
        return {"offset_into_first_range": a - f.starts[first], "terms": terms, key: fetch}

    def _fetch(self, key: str, c0: int, c1: int, v1: bool) -> list[dict[str, Any]]:
        """One signed URL per xorb; a range of two or more chunks split in two (v2), so the
        answer to it is multipart/byteranges as the Hub's CDN sends."""
        offsets = self.store.xorbs[key].offsets
        cuts = [c0, c1] if v1 or c1 - c0 < 2 else [c0, (c0 + c1) // 2, c1]
        ranges = [{"chunks": {"start": s, "end": e},
                   "bytes": {"start": offsets[s], "end": offsets[e] - 1}}
                  for s, e in zip(cuts, cuts[1:], strict=False)]
        spec = ",".join(f"{r['bytes']['start']}-{r['bytes']['end']}" for r in ranges)
        expires = int(time.time() + 60)
        url = (f"{self.url}/xorb/{key}?X-Xet-Signed-Range=bytes%3D{spec}&Expires={expires}"
               f"&Signature={self._sign(f'/xorb/{key}:{spec}', expires)}")
        if v1:
            r = ranges[0]
            return [{"range": r["chunks"], "url": url, "url_range": r["bytes"]}]
        return [{"url": url, "ranges": ranges}]

    async def _xorb(self, request: web.Request) -> web.StreamResponse:
        key, q = request.match_info["hash"], request.query
        spec = q.get("X-Xet-Signed-Range", "").removeprefix("bytes=")
        expires = int(q.get("Expires", "0"))
        good = hmac.compare_digest(q.get("Signature", ""),
                                   self._sign(f"/xorb/{key}:{spec}", expires))
        x = self.xet_faults
        status = 206
        if x.expire_urls or not good or expires < time.time() or key not in self.store.xorbs:
            x.expire_urls = max(0, x.expire_urls - 1)
            status = 403
        elif request.headers.get("Range") != f"bytes={spec}":
            status = 403  # the signature authorizes exactly the signed ranges
        self._record(request, "xet_xorb", status)
        if status != 206:
            return web.Response(status=status)
        data = self.store.xorbs[key].data
        parts = [tuple(int(v) for v in s.split("-")) for s in spec.split(",")]
        bodies = [self._tampered(data[s:e + 1]) for s, e in parts]
        if len(parts) == 1:
            (s, e), body = parts[0], bodies[0]
            return web.Response(status=206, body=body, headers={
                "Content-Range": f"bytes {s}-{e}/{len(data)}"})
        mp = MultipartWriter("byteranges")
        for (s, e), body in zip(parts, bodies, strict=True):
            mp.append(body, {"Content-Type": "application/octet-stream",
                             "Content-Range": f"bytes {s}-{e}/{len(data)}"})
        return web.Response(status=206, body=mp, headers={
            "Content-Type": f"multipart/byteranges; boundary={mp.boundary}"})

    def _tampered(self, body: bytes) -> bytes:
        out = bytearray(body)
        if self.xet_faults.flip_xorb_byte:
            out[xorb.HEADER + 1] ^= 0x01  # the first chunk's payload
        if self.xet_faults.bad_chunk_header:
            out[1] = (out[1] + 1) % 256  # its compressed size's low byte
        return bytes(out)

