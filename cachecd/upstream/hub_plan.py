"""Turning a batch of wanted experts into as few exact Range requests as is sensible.

Invariants:
- Every byte range of every entry lies inside exactly one planned request, and a request covers
  one file only.
- A request spans at most ``max_bytes`` (unless a single range alone is bigger) and serves at most
  ``max_experts`` experts (fewer when that keeps ``parallel`` requests going); neighbours are
  merged only across a gap of at most ``max_gap`` bytes (the gap is downloaded and thrown away,
  cheaper than another round trip), and a request already ``target_bytes`` long takes no further
  expert (pieces of an expert it already serves still join it).
- Pieces of an entry are numbered by their position in ``entry.ranges``, so the expert's bytes are
  the pieces concatenated in that order, whichever requests they came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cachecd import constants

DEFAULT_MAX_GAP = 1 << 20
DEFAULT_TARGET_BYTES = constants.COALESCE_TARGET_BYTES


class RangeLike(Protocol):
    file: str
    start: int
    end: int


class EntryLike(Protocol):
    layer: int
    expert: int
    nbytes: int
    xxh3: bytes

    @property
    def ranges(self) -> Sequence[RangeLike]: ...


@dataclass(frozen=True)
class Piece:
    """Range ``part`` of entry number ``entry``: absolute [start, end) in the request's file."""

    entry: int
    part: int
    start: int
    end: int


@dataclass
class RangeRequest:
    file: str
    start: int
    end: int
    pieces: list[Piece] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.end - self.start

    def experts(self) -> set[int]:
        return {p.entry for p in self.pieces}


def plan_requests(
    entries: Sequence[EntryLike],
    *,
    max_bytes: int,
    max_experts: int,
    max_gap: int = DEFAULT_MAX_GAP,
    parallel: int = 1,
    target_bytes: int = DEFAULT_TARGET_BYTES,
) -> list[RangeRequest]:
    """Coalesce the entries' ranges, file by file, in offset order.

    With ``parallel`` > 1, a request serves at most ceil(len(entries) / parallel) experts, so a
    small batch is still spread over ``parallel`` streams (one stream is slower than several,
    on a CDN as on a local server) and coalescing only trims the per-request overhead.
    Big experts (``target_bytes`` or more, like K3's 17.5 MB) each get their own request: merging
    them saves nothing worth a round trip, and lone experts finish one at a time, so their
    verify and store overlap the downloads still running (measured: 16 K3 experts stored ~25 %
    faster one per request than two per request).
    """
    max_experts = max(1, min(max_experts, -(-len(entries) // max(1, parallel))))
    by_file: dict[str, list[Piece]] = {}
    for i, entry in enumerate(entries):
        for part, rng in enumerate(entry.ranges):
            by_file.setdefault(rng.file, []).append(Piece(i, part, rng.start, rng.end))
    out: list[RangeRequest] = []
    for file in sorted(by_file):
        limits = _Limits(max_bytes, max_experts, max_gap, target_bytes)
        out.extend(_coalesce_file(file, by_file[file], limits))
    return out


@dataclass(frozen=True)
class _Limits:
    max_bytes: int
    max_experts: int
    max_gap: int
    target_bytes: int


def _coalesce_file(file: str, pieces: list[Piece], limits: _Limits) -> list[RangeRequest]:
    pieces.sort(key=lambda p: (p.start, p.end))
    out: list[RangeRequest] = []
    cur: RangeRequest | None = None
    cur_experts: set[int] = set()
    for piece in pieces:
        if cur is not None and _fits(cur, cur_experts, piece, limits):
            cur.end = max(cur.end, piece.end)
            cur.pieces.append(piece)
            cur_experts.add(piece.entry)
            continue
        cur = RangeRequest(file, piece.start, piece.end, [piece])
        cur_experts = {piece.entry}
        out.append(cur)
    return out


def _fits(cur: RangeRequest, experts: set[int], piece: Piece, limits: _Limits) -> bool:
    if piece.start - cur.end > limits.max_gap:
        return False
    if max(cur.end, piece.end) - cur.start > limits.max_bytes:
        return False
    if piece.entry in experts:
        return True
    return len(experts) < limits.max_experts and cur.length < limits.target_bytes
