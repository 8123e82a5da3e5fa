"""Partial Merkle trees of a run of chunks: xet-core's ``MerkleHashSubtree``, the "opaque" gap
trees of ``/v2/file-chunk-hashes`` (hub-docs ``docs/xet/api.md``; xet-core
``merklehash/merkle_hash_subtree.rs`` for the algorithm and the JSON form).

A run of nodes that does not start at the file's first chunk cannot be grouped from its first
node, because the grouping depends on where the previous group ended. But a node group boundary
is fixed whatever comes before once three natural cuts (nodes whose hash ends a group) follow each
other at gaps of 3 to 7 nodes: from the middle one on, the groups are those of the whole file
(``find_stable_start``); the mirror rule fixes the end (``find_stable_end``). So each level keeps
an unstable left and right remainder as they are and promotes the merged middle to the next
level: a "hump" of O(log n) nodes. Two adjacent humps merge level by level (remainders, carry
and the neighbour's remainders in order), and a hump that reaches from the file's start to its
end closes into one node: the tree's root, the same as :func:`hashing.merkle_root`.

JSON: ``{"nodes": [{"hash": hex, "size": n}, ...], "levels": [[left, right], ...],
"at_start": bool, "at_end": bool}``, nodes flat as ``[L0 left, L1 left, ..., Lk left,
Lk right, ..., L0 right]``. A malformed one raises ``XetProofError``: nothing of a proof is
trusted, only the root it recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachecd.errors import XetFormatError, XetProofError
from cachecd.xet.hashing import (
    EMPTY,
    MAX_GROUP,
    Node,
    collapse_level,
    from_hex,
    is_natural_cut,
    to_hex,
)

MIN_GROUP = 2
MAX_NODES = 1 << 16  # far above any real file's hump (~1,000 nodes for 1e8 chunks)
MAX_LEVELS = 64


def _valid_gap(gap: int) -> bool:
    return MIN_GROUP < gap < MAX_GROUP - 1


def find_stable_start(nodes: Sequence[Node]) -> int | None:
    """The first index from which groups are the same whatever precedes ``nodes``."""
    if len(nodes) < MIN_GROUP + 1:
        return None
    cuts = [i for i, (h, _) in enumerate(nodes) if is_natural_cut(h)]
    for a, b, c in zip(cuts, cuts[1:], cuts[2:], strict=False):
        if _valid_gap(b - a) and _valid_gap(c - b):
            return b + 1
    return None


def find_stable_end(nodes: Sequence[Node]) -> int | None:
    """The last index up to which groups are the same whatever follows ``nodes``."""
    if len(nodes) < MIN_GROUP + 1:
        return None
    cuts = [i for i, (h, _) in enumerate(nodes) if is_natural_cut(h)][::-1]
    for c, b, a in zip(cuts, cuts[1:], cuts[2:], strict=False):
        # c > b > a scanning right to left: b's group end is fixed by c.
        if _valid_gap(c - b) and _valid_gap(b - a):
            return b + 1
    return None


def split_and_promote(nodes: Sequence[Node], at_start: bool,
                      at_end: bool) -> tuple[int, int, list[Node]]:
    """(left remainder length, right remainder length, the merged middle)."""
    n = len(nodes)
    if n <= 1:
        return n, 0, []
    start = 0 if at_start else find_stable_start(nodes)
    if start is None:
        return n, 0, []
    end: int | None = n
    if not at_end:
        tail = find_stable_end(nodes[start:])
        end = None if tail is None else start + tail
    if end is None or start >= end:
        return n, 0, []
    return start, n - end, collapse_level(nodes[start:end])


@dataclass
class Subtree:
    """A hump: per level its left and right remainders (level 0 = chunks)."""

    lefts: list[list[Node]]
    rights: list[list[Node]]
    at_start: bool
    at_end: bool

    @classmethod
    def from_chunks(cls, at_start: bool, chunks: Sequence[Node], at_end: bool) -> Subtree:
        tree = cls([], [], at_start, at_end)
        tree._climb([], list(chunks), [])
        return tree

    def is_empty(self) -> bool:
        return not any(self.lefts) and not any(self.rights)

    def size(self) -> int:
        """Bytes the hump covers (each node's size is what it covers; together they tile it)."""
        return sum(s for level in self.lefts + self.rights for _, s in level)

    def _level(self, side: list[list[Node]], i: int) -> list[Node]:
        return side[i] if i < len(side) else []

    def _climb(self, lows: list[list[Node]], first: list[Node], highs: list[list[Node]]) -> None:
        """Build levels from ``first`` (level 0's nodes); ``lows``/``highs``: the other hump's
        remainders to merge in, left of and right of the carry (empty when building)."""
        levels = max(len(lows), len(highs))
        lefts: list[list[Node]] = []
        rights: list[list[Node]] = []
        carry = first
        level = 0
        while level < levels or carry:
            full = (self._level(lows, level) + carry + self._level(highs, level)
                    if level < levels else carry)
            if level >= levels and len(full) == 1:
                lefts.append(full)
                rights.append([])
                break
            lo, ro, carry = split_and_promote(
                full, self.at_start and not any(lefts), self.at_end and not any(rights))
            lefts.append(full[:lo])
            rights.append(full[len(full) - ro:])
            level += 1
        if not lefts:
            lefts, rights = [[]], [[]]
        while len(lefts) > 1 and not lefts[-1] and not rights[-1]:
            lefts.pop()
            rights.pop()
        self.lefts, self.rights = lefts, rights

    def merge_into(self, other: Subtree) -> None:
        """Append ``other`` (the run right after this one) to this hump."""
        if self.at_end or other.at_start:
            raise XetProofError("proof trees out of order: a tree that ends the file is followed, "
                                "or one that starts it follows another")
        n = max(len(self.lefts), len(other.lefts))
        lows = [self._level(self.lefts, i) + self._level(self.rights, i) for i in range(n)]
        highs = [other._level(other.lefts, i) + other._level(other.rights, i) for i in range(n)]
        self.at_end = other.at_end
        # Level 0's carry is empty: each level's middle comes from the merge of the one below.
        self._climb(lows, [], highs)

    def root(self) -> bytes | None:
        """The tree's root if the hump is closed (file start to end), else None."""
        if not (self.at_start and self.at_end):
            return None
        if self.is_empty():
            return EMPTY
        if any(self.lefts[:-1]) or any(self.rights) or len(self.lefts[-1]) != 1:
            return None
        return self.lefts[-1][0][0]

    def to_json(self) -> dict[str, Any]:
        flat = [n for level in self.lefts for n in level]
        flat += [n for level in reversed(self.rights) for n in level]
        return {"nodes": [{"hash": to_hex(h), "size": s} for h, s in flat],
                "levels": [[len(lo), len(hi)] for lo, hi in zip(self.lefts, self.rights,
                                                                strict=True)],
                "at_start": self.at_start, "at_end": self.at_end}

    @classmethod
    def from_json(cls, raw: Any) -> Subtree:
        try:
            return _parse(raw)
        except (KeyError, TypeError, ValueError, XetFormatError) as exc:
            raise XetProofError(f"a proof tree is malformed ({exc}): refused") from exc


def merge(trees: Sequence[Subtree]) -> Subtree:
    """The trees, adjacent and in order, as one hump."""
    if not trees:
        return Subtree.from_chunks(True, [], True)
    out = Subtree([list(x) for x in trees[0].lefts], [list(x) for x in trees[0].rights],
                  trees[0].at_start, trees[0].at_end)
    for tree in trees[1:]:
        out.merge_into(tree)
    return out


def _parse(raw: Any) -> Subtree:
    nodes, levels = raw["nodes"], raw["levels"]
    if not isinstance(nodes, list) or not isinstance(levels, list):
        raise TypeError("nodes and levels must be lists")
    if len(nodes) > MAX_NODES or len(levels) > MAX_LEVELS or not levels:
        raise ValueError(f"{len(nodes)} nodes in {len(levels)} levels")
    flat: list[Node] = []
    for node in nodes:
        size = node["size"]
        if type(size) is not int or size < 0:
            raise ValueError(f"node size {size!r}")
        flat.append((from_hex(str(node["hash"])), size))
    counts = [(int(lo), int(hi)) for lo, hi in levels]
    if any(lo < 0 or hi < 0 for lo, hi in counts) or sum(lo + hi for lo, hi in counts) != len(flat):
        raise ValueError("levels do not add up to the nodes")
    at_start, at_end = raw["at_start"], raw["at_end"]
    if type(at_start) is not bool or type(at_end) is not bool:
        raise TypeError("at_start and at_end must be booleans")
    lefts, pos = [], 0
    for lo, _ in counts:
        lefts.append(flat[pos:pos + lo])
        pos += lo
    rights: list[list[Node]] = [[] for _ in counts]
    for i in reversed(range(len(counts))):
        rights[i] = flat[pos:pos + counts[i][1]]
        pos += counts[i][1]
    return Subtree(lefts, rights, at_start, at_end)
