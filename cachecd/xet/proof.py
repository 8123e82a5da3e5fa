"""Proving a byte range of a file against its xet hash: ``/v2/file-chunk-hashes`` (hub-docs
``docs/xet/api.md``, section 9; the window rule of xet-core's ``chunk_window_builder.rs``).

The server widens each asked ("dirty") range to the chunks that hold it, then on to the right
until two consecutive chunks both have a "stable" size (16 KiB to 120 KiB: re-chunking from the
window's start is then sure to meet the stored cuts again); ranges whose windows meet are one
window. The answer: ``{"totalChunks", "fileSize", "windows": [{"dirtyByteRange": [s, e)}],
"hashRanges": [before, between..., after], "gapVerification": []}``, each gap a
:class:`~cachecd.xet.subtree.Subtree` in JSON or ``null`` where it is empty. This hub keeps no
shard verification entries, so ``gapVerification`` is always empty (the spec allows that).

A client holding a window's bytes hashes its chunks, builds the window's own subtree and merges
``[before, window, after]``; the closed root, keyed with the zero key, must be the file's xet
hash. Every other field is checked against that root or against each other; any disagreement
raises ``XetProofError``. :func:`verify_window` handles one window (what a client asks for one
range).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cachecd.errors import XetProofError
from cachecd.xet.hashing import Node, file_hash_from_root, to_hex
from cachecd.xet.subtree import Subtree, merge

STABLE_MIN = 16 * 1024  # 2 x the minimum chunk
STABLE_MAX = 120 * 1024  # the maximum chunk less the minimum


def is_stable_size(size: int) -> bool:
    return STABLE_MIN <= size < STABLE_MAX


def _windows(leaves: Sequence[Node], dirty: Sequence[tuple[int, int]]
             ) -> tuple[list[list[int]], list[list[Node]]]:
    """Windows ``[start, end)`` and the chunks of each gap around them (one more than windows)."""
    windows: list[list[int]] = []
    gaps: list[list[Node]] = [[]]
    idx, in_window, prev = 0, False, None  # idx: the dirty range now open or next
    cursor = 0

    def overlaps(i: int, a: int, b: int) -> bool:
        return i < len(dirty) and b > dirty[i][0] and a < dirty[i][1]

    for h, size in leaves:
        start, end = cursor, cursor + size
        cursor = end
        if not in_window:
            if overlaps(idx, start, end):
                windows.append([start, end])
                in_window, prev = True, None
            else:
                gaps[-1].append((h, size))
                continue
        elif overlaps(idx, start, end) or overlaps(idx + 1, start, end):
            if not overlaps(idx, start, end):
                idx += 1
            windows[-1][1] = end
            prev = None
        else:
            windows[-1][1] = end
            if prev is not None and is_stable_size(prev) and is_stable_size(size):
                idx, in_window, prev = idx + 1, False, None
                gaps.append([])
                continue
            prev = size
        while idx + 1 < len(dirty) and end > dirty[idx + 1][0]:
            idx += 1  # a later range this chunk already reaches joins the open window
    if in_window:
        gaps.append([])
    return windows, gaps


def build_answer(leaves: Sequence[Node], file_size: int,
                 dirty: tuple[int, int] | Sequence[tuple[int, int]]) -> dict[str, Any]:
    """The server's answer for ``dirty``: one ``(start, end)`` range or several, ends exclusive
    (the header's inclusive ends already turned), sorted, clamped to the file. Raises
    ``ValueError`` when no range is left inside the file (the endpoint's 400)."""
    ranges: list[tuple[int, int]] = (
        [(int(dirty[0]), int(dirty[1]))] if isinstance(dirty[0], int)  # type: ignore[arg-type]
        else [(int(a), int(b)) for a, b in dirty])  # type: ignore[misc]
    clamped = sorted((a, min(b, file_size)) for a, b in ranges)
    clamped = [(a, b) for a, b in clamped if a < b and a < file_size]
    if not clamped:
        raise ValueError("no dirty range lies inside the file")
    windows, gaps = _windows(leaves, clamped)
    trees = []
    for i, gap in enumerate(gaps):
        tree = Subtree.from_chunks(i == 0, gap, i == len(gaps) - 1)
        trees.append(None if tree.is_empty() else tree.to_json())
    return {"totalChunks": len(leaves), "fileSize": file_size,
            "windows": [{"dirtyByteRange": w} for w in windows],
            "hashRanges": trees, "gapVerification": []}


def answer_window(answer: Any, want_start: int, want_end: int) -> tuple[int, int]:
    """The one window ``[start, end)`` of an answer asked for ``[want_start, want_end)``, checked
    to be well formed and to cover that range (so the client knows which bytes to read)."""
    try:
        windows = answer["windows"]
        size = answer["fileSize"]
        if len(windows) != 1 or len(answer["hashRanges"]) != 2:
            raise XetProofError(f"the proof has {len(windows)} windows and "
                                f"{len(answer['hashRanges'])} gap trees; 1 and 2 were asked for")
        start, end = windows[0]["dirtyByteRange"]
    except (KeyError, TypeError, ValueError) as exc:
        raise XetProofError(f"the proof answer is malformed ({exc!r}): refused") from exc
    if not all(type(v) is int for v in (start, end, size)):
        raise XetProofError("the proof's window and file size must be integers")
    if not (0 <= start <= want_start and want_end <= end <= size and start < end):
        raise XetProofError(f"the proof's window [{start}, {end}) does not cover the range asked "
                            f"[{want_start}, {want_end}) of a {size}-byte file")
    return start, end


def _gap(raw: Any, first: bool) -> Subtree | None:
    if raw is None:
        return None
    tree = Subtree.from_json(raw)
    if tree.at_start != first or tree.at_end == first:
        raise XetProofError("a proof gap tree is flagged for the wrong side of its window")
    return tree


def verify_window(file_hash: bytes, answer: Any, window_start: int,
                  window_leaves: Sequence[Node], *,
                  want: tuple[int, int] | None = None) -> None:
    """Check that ``window_leaves`` (the ``(chunk_hash, size)`` of the bytes read from
    ``window_start``) sit at that offset of the file named ``file_hash``, using the server's
    ``answer``. ``want``: the range asked for, which the window must cover. Returns nothing;
    raises ``XetProofError`` on any disagreement."""
    if not window_leaves:
        raise XetProofError("no chunks to prove")
    window_size = sum(s for _, s in window_leaves)
    lo, hi = want if want is not None else (window_start, window_start + window_size)
    start, end = answer_window(answer, lo, hi)
    if start != window_start or end - start != window_size:
        raise XetProofError(f"the proof is for window [{start}, {end}), the chunks held are "
                            f"[{window_start}, {window_start + window_size})")
    before = _gap(answer["hashRanges"][0], True)
    after = _gap(answer["hashRanges"][1], False)
    if (before.size() if before else 0) != start:
        raise XetProofError(f"the proof's chunks before the window cover "
                            f"{before.size() if before else 0} bytes, the window starts at {start}")
    if end + (after.size() if after else 0) != answer["fileSize"]:
        raise XetProofError("the proof's chunks after the window do not reach the file's end")
    middle = Subtree.from_chunks(before is None, window_leaves, after is None)
    root = merge([t for t in (before, middle, after) if t is not None]).root()
    if root is None:
        raise XetProofError("the proof's trees do not close into one root")
    got = file_hash_from_root(root, answer["fileSize"])
    if got != file_hash:
        raise XetProofError(f"range [{start}, {end}) recomputes xet hash {to_hex(got)}, the "
                            f"file's is {to_hex(file_hash)}: the bytes or the proof are wrong")
