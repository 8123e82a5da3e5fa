"""The Xet content store's JSON answers, checked for shape before anything acts on them.

Pure functions, no I/O. Nothing here is trusted for the bytes: a reconstruction only says where
to fetch chunks, and the proof decides (``xet_source``). What is checked here is what keeps a
malformed or hostile answer from costing more than a refusal: types, hash spellings, chunk and
byte ranges that are ordered and bounded, a window that covers the asked range within a slack.

Invariant: every parser returns frozen values or raises ``WireError`` naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_HEX64 = re.compile(r"[0-9a-f]{64}")


class WireError(ValueError):
    """An answer that is not what the spec says it is."""


@dataclass(frozen=True)
class Term:
    """Chunks [start, end) of xorb ``xorb``, ``unpacked`` bytes once decoded."""

    xorb: str
    start: int
    end: int
    unpacked: int


@dataclass(frozen=True)
class XorbRange:
    """Chunks [chunk_start, chunk_end) of a xorb, stored at bytes [byte_start, byte_end]
    (inclusive end, as the Range header spells it)."""

    chunk_start: int
    chunk_end: int
    byte_start: int
    byte_end: int

    @property
    def length(self) -> int:
        return self.byte_end - self.byte_start + 1


@dataclass(frozen=True)
class XorbFetch:
    """One signed URL and the ranges of one xorb it serves, fetched in one request."""

    xorb: str
    url: str
    ranges: tuple[XorbRange, ...]


@dataclass(frozen=True)
class Reconstruction:
    offset: int  # bytes of the first term to skip (0 when the asked range starts on a chunk)
    terms: tuple[Term, ...]
    fetches: tuple[XorbFetch, ...]


@dataclass(frozen=True)
class Window:
    """What ``/v2/file-chunk-hashes`` answered for one dirty range: the chunk-aligned window
    [start, end) to read, the file's size, and the whole answer for ``proof.verify_window``."""

    start: int
    end: int
    file_size: int
    answer: dict[str, Any]


@dataclass(frozen=True)
class Token:
    access_token: str
    cas_url: str
    exp: float  # unix time


def _int(doc: Any, key: str, where: str, low: int = 0) -> int:
    value = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise WireError(f"{where}.{key}: {value!r} is not an integer >= {low}")
    return value


def _hash(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise WireError(f"{where}: {str(value)[:80]!r} is not a 64-hex hash")
    return value


def _span(doc: Any, where: str, inclusive: bool) -> tuple[int, int]:
    start, end = _int(doc, "start", where), _int(doc, "end", where)
    if end < start or (end == start and not inclusive):
        raise WireError(f"{where}: range {start}-{end} is empty or reversed")
    return start, end


def _terms(doc: Any) -> tuple[Term, ...]:
    terms = doc.get("terms")
    if not isinstance(terms, list) or not terms:
        raise WireError("terms: not a non-empty list")
    out = []
    for i, t in enumerate(terms):
        where = f"terms[{i}]"
        if not isinstance(t, dict):
            raise WireError(f"{where}: not an object")
        start, end = _span(t.get("range"), f"{where}.range", inclusive=False)
        out.append(Term(_hash(t.get("hash"), f"{where}.hash"), start, end,
                        _int(t, "unpacked_length", where, low=1)))
    return tuple(out)


def _range(doc: Any, where: str) -> XorbRange:
    if not isinstance(doc, dict):
        raise WireError(f"{where}: not an object")
    c0, c1 = _span(doc.get("chunks"), f"{where}.chunks", inclusive=False)
    b0, b1 = _span(doc.get("bytes"), f"{where}.bytes", inclusive=True)
    return XorbRange(c0, c1, b0, b1)


def _url(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise WireError(f"{where}: not an http(s) URL")
    return value


def _fetches_v2(doc: Any) -> tuple[XorbFetch, ...]:
    xorbs = doc.get("xorbs")
    if not isinstance(xorbs, dict):
        raise WireError("xorbs: not an object")
    out = []
    for xorb, entries in xorbs.items():
        _hash(xorb, "xorbs key")
        if not isinstance(entries, list):
            raise WireError(f"xorbs[{xorb[:12]}]: not a list")
        for j, e in enumerate(entries):
            where = f"xorbs[{xorb[:12]}][{j}]"
            if not isinstance(e, dict) or not isinstance(e.get("ranges"), list) or not e["ranges"]:
                raise WireError(f"{where}: no ranges")
            ranges = tuple(_range(r, f"{where}.ranges[{k}]") for k, r in enumerate(e["ranges"]))
            out.append(XorbFetch(xorb, _url(e.get("url"), f"{where}.url"), _ordered(ranges, where)))
    return tuple(out)


def _fetches_v1(doc: Any) -> tuple[XorbFetch, ...]:
    info = doc.get("fetch_info")
    if not isinstance(info, dict):
        raise WireError("fetch_info: not an object")
    out = []
    for xorb, entries in info.items():
        _hash(xorb, "fetch_info key")
        if not isinstance(entries, list):
            raise WireError(f"fetch_info[{xorb[:12]}]: not a list")
        for j, e in enumerate(entries):
            where = f"fetch_info[{xorb[:12]}][{j}]"
            if not isinstance(e, dict):
                raise WireError(f"{where}: not an object")
            r = _range({"chunks": e.get("range"), "bytes": e.get("url_range")}, where)
            out.append(XorbFetch(xorb, _url(e.get("url"), f"{where}.url"), (r,)))
    return tuple(out)


def _ordered(ranges: tuple[XorbRange, ...], where: str) -> tuple[XorbRange, ...]:
    for a, b in zip(ranges, ranges[1:], strict=False):
        if b.chunk_start < a.chunk_end or b.byte_start <= a.byte_end:
            raise WireError(f"{where}: ranges overlap or are out of order")
    return ranges


def _covered(term: Term, fetches: tuple[XorbFetch, ...]) -> bool:
    """Whether the fetches of ``term``'s xorb hold each of its chunks."""
    pos = term.start
    for r in sorted((r for f in fetches if f.xorb == term.xorb for r in f.ranges),
                    key=lambda r: r.chunk_start):
        if r.chunk_start <= pos < r.chunk_end:
            pos = r.chunk_end
        if pos >= term.end:
            return True
    return False


def parse_reconstruction(doc: Any, *, v1: bool = False) -> Reconstruction:
    """A ``/v2/reconstructions`` answer (``/v1`` with ``v1``) in one form; every term's chunks
    served by some fetch of its xorb."""
    if not isinstance(doc, dict):
        raise WireError("reconstruction: not an object")
    terms = _terms(doc)
    fetches = _fetches_v1(doc) if v1 else _fetches_v2(doc)
    for i, t in enumerate(terms):
        if not _covered(t, fetches):
            raise WireError(f"terms[{i}]: chunks {t.start}-{t.end} of {t.xorb[:12]} are in no fetch")
    return Reconstruction(_int(doc, "offset_into_first_range", "reconstruction"), terms, fetches)


def parse_window(doc: Any, start: int, end: int, *, size: int | None, slack: int) -> Window:
    """A ``/v2/file-chunk-hashes`` answer for the one dirty range [start, end): its window must
    contain the range, lie in the file, and add at most ``slack`` bytes to it."""
    if not isinstance(doc, dict):
        raise WireError("file-chunk-hashes: not an object")
    file_size = _int(doc, "fileSize", "file-chunk-hashes", low=1)
    if size is not None and file_size != size:
        raise WireError(f"fileSize {file_size} is not the file's {size} bytes")
    windows = doc.get("windows")
    if not isinstance(windows, list) or len(windows) != 1 or not isinstance(windows[0], dict):
        raise WireError("windows: not one window for the one range asked")
    span = windows[0].get("dirtyByteRange")
    if (not isinstance(span, list) or len(span) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in span)):
        raise WireError(f"windows[0].dirtyByteRange: {str(span)[:80]!r} is not [start, end)")
    w0, w1 = span
    if not (0 <= w0 <= start and end <= w1 <= file_size):
        raise WireError(f"window {w0}-{w1} does not hold bytes {start}-{end} of {file_size}")
    if (w1 - w0) - (end - start) > slack:
        raise WireError(f"window {w0}-{w1} adds {(w1 - w0) - (end - start)} bytes to the range "
                        f"(at most {slack} taken)")
    ranges = doc.get("hashRanges")
    if not isinstance(ranges, list) or len(ranges) != 2:
        raise WireError("hashRanges: not the two gaps around one window")
    return Window(w0, w1, file_size, doc)


def parse_token(doc: Any) -> Token:
    """The xet-read-token answer: ``accessToken``, ``exp``, ``casUrl`` (the spec's JSON)."""
    if not isinstance(doc, dict):
        raise WireError("xet token: not an object")
    token, cas = doc.get("accessToken"), doc.get("casUrl")
    if not isinstance(token, str) or not token or len(token) > 64000:
        raise WireError("xet token: accessToken missing or too long")
    exp = doc.get("exp")
    if not isinstance(exp, int | float) or isinstance(exp, bool):
        raise WireError("xet token: exp is not a number")
    return Token(token, _url(cas, "xet token: casUrl").rstrip("/"), float(exp))
