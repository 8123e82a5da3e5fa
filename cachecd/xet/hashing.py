"""Xet hashes (hub-docs ``docs/xet/hashing.md``, ``api.md`` for the hex form).

A chunk hash is BLAKE3 keyed with DATA_KEY over the chunk's bytes. A tree node is BLAKE3 keyed
with INTERNAL_NODE_KEY over one line ``"{hex} : {size}\\n"`` per child; which children share a
parent is decided by the children themselves (a group ends after a child whose last 8-byte word,
read little-endian, is divisible by 4, at 3 to 9 children; 2 at least), level after level until
one node is left: the xorb hash. A file hash is that root keyed again with 32 zero bytes; an
empty file's hash is 32 zero bytes (xet-core's ``file_hash`` of no chunks, un-keyed).

Hashes are raw 32-byte strings here; ``to_hex``/``from_hex`` give the spec's string form, each
8-byte word printed as a little-endian u64 (not the bytes in order).
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3

from cachecd.errors import XetFormatError

DATA_KEY = bytes([
    102, 151, 245, 119, 91, 149, 80, 222, 49, 53, 203, 172, 165, 151, 24, 28,
    157, 228, 33, 16, 155, 235, 43, 88, 180, 208, 176, 75, 147, 173, 242, 41,
])
INTERNAL_NODE_KEY = bytes([
    1, 126, 197, 199, 165, 71, 41, 150, 253, 148, 102, 102, 180, 138, 2, 230,
    93, 221, 83, 111, 55, 199, 109, 210, 248, 99, 82, 230, 74, 83, 113, 63,
])
ZERO_KEY = bytes(32)
EMPTY = bytes(32)
MEAN_FANOUT = 4
MAX_GROUP = 2 * MEAN_FANOUT + 1

Node = tuple[bytes, int]  # (hash, byte size of what it covers)


def chunk_hash(data: bytes | bytearray | memoryview) -> bytes:
    """The chunk's hash: BLAKE3 keyed with the data key."""
    return blake3.blake3(data, key=DATA_KEY).digest()


def to_hex(h: bytes) -> str:
    """The spec's string form: each 8-byte word as a little-endian u64 in hex."""
    if len(h) != 32:
        raise XetFormatError(f"a xet hash is 32 bytes, got {len(h)}")
    return "".join(h[i:i + 8][::-1].hex() for i in range(0, 32, 8))


def from_hex(s: str) -> bytes:
    """Inverse of :func:`to_hex`; a malformed string raises ``XetFormatError``."""
    if len(s) != 64:
        raise XetFormatError(f"a xet hash is 64 hex digits, got {len(s)}: {s[:80]!r}")
    try:
        raw = bytes.fromhex(s)
    except ValueError as exc:
        raise XetFormatError(f"not a hex xet hash: {s!r}") from exc
    return b"".join(raw[i:i + 8][::-1] for i in range(0, 32, 8))


def is_natural_cut(h: bytes) -> bool:
    """Whether a node ends its group (its last word, little-endian, divisible by 4)."""
    return h[24] % MEAN_FANOUT == 0


def next_group(nodes: Sequence[Node]) -> int:
    """How many of ``nodes`` (from the start) the next parent takes."""
    if len(nodes) <= 2:
        return len(nodes)
    end = min(MAX_GROUP, len(nodes))
    for i in range(2, end):
        if is_natural_cut(nodes[i][0]):
            return i + 1
    return end


def merge_nodes(nodes: Sequence[Node]) -> Node:
    """One parent over ``nodes``: keyed BLAKE3 of their ``"{hex} : {size}\\n"`` lines."""
    text = "".join(f"{to_hex(h)} : {size}\n" for h, size in nodes)
    digest = blake3.blake3(text.encode(), key=INTERNAL_NODE_KEY).digest()
    return digest, sum(size for _, size in nodes)


def collapse_level(nodes: Sequence[Node]) -> list[Node]:
    """The next level up: ``nodes`` grouped by :func:`next_group` and merged."""
    out: list[Node] = []
    pos = 0
    while pos < len(nodes):
        take = next_group(nodes[pos:pos + MAX_GROUP])
        out.append(merge_nodes(nodes[pos:pos + take]))
        pos += take
    return out


def merkle_root(leaves: Sequence[Node]) -> bytes:
    """The aggregated hash of ``(hash, size)`` leaves (a xorb's hash); 32 zeros for none."""
    if not leaves:
        return EMPTY
    level = list(leaves)
    while len(level) > 1:
        level = collapse_level(level)
    return level[0][0]


def file_hash_from_root(root: bytes, file_size: int) -> bytes:
    """A file's hash from its tree's root (an empty file's is 32 zeros, un-keyed)."""
    if file_size == 0:
        return EMPTY
    return blake3.blake3(root, key=ZERO_KEY).digest()


def file_hash(leaves: Sequence[Node]) -> bytes:
    """A file's xet hash from its chunks' ``(hash, size)``."""
    if not leaves:
        return EMPTY
    return file_hash_from_root(merkle_root(leaves), sum(size for _, size in leaves))


def hash_chunks(data: bytes | bytearray | memoryview, ends: Sequence[int]) -> list[Node]:
    """``(chunk_hash, size)`` of each chunk of ``data`` ending at ``ends``."""
    view = memoryview(data)
    out: list[Node] = []
    start = 0
    for end in ends:
        out.append((chunk_hash(view[start:end]), end - start))
        start = end
    return out
