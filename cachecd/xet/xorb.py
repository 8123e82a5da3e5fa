"""Xorbs: chunks in a row, each behind an 8-byte header (hub-docs ``docs/xet/xorb.md``).

Header: version (0), compressed size (3 bytes LE), scheme, uncompressed size (3 bytes LE).
Schemes: 0 none, 1 LZ4 (frame format, as xet-core's lz4_flex frames), 2 byte grouping by 4
(every byte at position i mod 4 into group i, groups concatenated) then LZ4. A chunk is at most
128 KiB uncompressed; a compressed one is never let grow past that either (the spec stores a
chunk that does not shrink as it is), so a header claiming more is malformed, not just large.
A xorb is at most 64 MiB serialized. The hub builds xorbs with :class:`XorbBuilder`; readers
parse fetched byte ranges with :func:`decode_chunks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import lz4.frame

from cachecd.errors import XetFormatError
from cachecd.xet.chunking import MAX_CHUNK
from cachecd.xet.hashing import Node, merkle_root

HEADER = 8
VERSION = 0
NONE, LZ4, BG4_LZ4 = 0, 1, 2
SCHEMES = (NONE, LZ4, BG4_LZ4)
MAX_XORB_BYTES = 64 * 1024 * 1024
MAX_XORB_CHUNKS = 8 * 1024


def group4(data: bytes | memoryview) -> bytes:
    """Byte grouping: the bytes at positions 0, 4, 8 ..., then 1, 5, 9 ..., then 2 ..., then 3 ..."""
    raw = bytes(data)
    return b"".join(raw[i::4] for i in range(4))


def ungroup4(grouped: bytes) -> bytes:
    """Inverse of :func:`group4`: group i holds ``n // 4`` bytes, one more for i < ``n % 4``."""
    n = len(grouped)
    out = bytearray(n)
    pos = 0
    for i in range(4):
        size = n // 4 + (1 if i < n % 4 else 0)
        out[i::4] = grouped[pos:pos + size]
        pos += size
    return bytes(out)


def _compress(data: bytes | memoryview, scheme: int) -> bytes:
    if scheme == NONE:
        return bytes(data)
    if scheme == LZ4:
        return lz4.frame.compress(bytes(data))
    if scheme == BG4_LZ4:
        return lz4.frame.compress(group4(data))
    raise XetFormatError(f"unknown xet compression scheme {scheme}: 0 none, 1 LZ4, 2 BG4+LZ4")


def encode_chunk(data: bytes | memoryview, scheme: int) -> bytes:
    """One chunk as a xorb holds it: header and payload, compressed with ``scheme`` as asked."""
    if len(data) > MAX_CHUNK:
        raise XetFormatError(f"a xet chunk is at most {MAX_CHUNK} bytes, got {len(data)}")
    payload = _compress(data, scheme)
    if len(payload) >= 1 << 24:
        raise XetFormatError(f"compressed chunk of {len(payload)} bytes does not fit a header")
    head = (bytes([VERSION]) + len(payload).to_bytes(3, "little") + bytes([scheme])
            + len(data).to_bytes(3, "little"))
    return head + payload


def encode_chunk_auto(data: bytes | memoryview, scheme: int) -> bytes:
    """``scheme`` where it makes the chunk smaller, else stored as it is (the spec's SHOULD)."""
    packed = encode_chunk(data, scheme)
    if scheme != NONE and len(packed) >= HEADER + len(data):
        return encode_chunk(data, NONE)
    return packed


@dataclass(frozen=True)
class ChunkHeader:
    version: int
    compressed: int
    scheme: int
    size: int


def parse_header(buf: bytes | memoryview, pos: int) -> ChunkHeader:
    """The header at ``pos``; anything the spec does not allow raises ``XetFormatError``."""
    if pos + HEADER > len(buf):
        raise XetFormatError(f"xorb data cut short: a chunk header at byte {pos} needs {HEADER} "
                             f"bytes, {len(buf) - pos} left")
    raw = bytes(buf[pos:pos + HEADER])
    head = ChunkHeader(raw[0], int.from_bytes(raw[1:4], "little"), raw[4],
                       int.from_bytes(raw[5:8], "little"))
    if head.version != VERSION:
        raise XetFormatError(f"chunk header at byte {pos}: version {head.version}, expected 0")
    if head.scheme not in SCHEMES:
        raise XetFormatError(f"chunk header at byte {pos}: unknown compression scheme {head.scheme}")
    if head.size > MAX_CHUNK or head.compressed > MAX_CHUNK + 1024:
        raise XetFormatError(f"chunk header at byte {pos}: sizes {head.compressed}/{head.size} "
                             f"past the {MAX_CHUNK}-byte chunk limit")
    if head.scheme == NONE and head.compressed != head.size:
        raise XetFormatError(f"chunk header at byte {pos}: uncompressed chunk with sizes "
                             f"{head.compressed} != {head.size}")
    return head


def _decompress(payload: bytes | memoryview, head: ChunkHeader, pos: int) -> bytes | memoryview:
    if head.scheme == NONE:
        return payload  # a view of the fetched range: a stored chunk is not copied
    try:
        # max_length bounds the output, so a hostile frame cannot expand past the header's size.
        dctx = lz4.frame.LZ4FrameDecompressor()
        raw = dctx.decompress(bytes(payload), max_length=head.size + 1)
        complete = dctx.eof
    except RuntimeError as exc:
        raise XetFormatError(f"chunk at byte {pos}: LZ4 data does not decode ({exc})") from exc
    if len(raw) != head.size or not complete:
        raise XetFormatError(f"chunk at byte {pos}: decodes to {len(raw)} bytes, header says "
                             f"{head.size}")
    return ungroup4(raw) if head.scheme == BG4_LZ4 else raw


def decode_chunks(buf: bytes | memoryview,
                  expect: int | None = None) -> list[bytes | memoryview]:
    """Every chunk in ``buf`` (a fetched xorb range: headers and payloads back to back), each
    decompressed; ``expect``: how many chunks the range must hold exactly. A stored chunk of a
    memoryview ``buf`` is a view of it (kept alive by the view), not a copy."""
    out: list[bytes | memoryview] = []
    pos = 0
    while pos < len(buf):
        if expect is not None and len(out) == expect:
            raise XetFormatError(f"xorb range holds more than the {expect} chunks expected "
                                 f"({len(buf) - pos} bytes left at byte {pos})")
        head = parse_header(buf, pos)
        start = pos + HEADER
        if start + head.compressed > len(buf):
            raise XetFormatError(f"chunk at byte {pos}: payload of {head.compressed} bytes cut "
                                 f"short ({len(buf) - start} left)")
        out.append(_decompress(buf[start:start + head.compressed], head, pos))
        pos = start + head.compressed
    if expect is not None and len(out) != expect:
        raise XetFormatError(f"xorb range holds {len(out)} chunks, {expect} expected")
    return out


@dataclass
class XorbBuilder:
    """Packs chunks into one xorb; ``full`` says when the next chunk would not fit.

    ``offsets[i]`` is where chunk i's header starts in the serialized xorb (``offsets[-1]``
    its end), which is what a reconstruction's byte ranges are made of.
    """

    scheme: int = LZ4
    parts: list[bytes] = field(default_factory=list)
    leaves: list[Node] = field(default_factory=list)
    offsets: list[int] = field(default_factory=lambda: [0])

    def full(self, next_size: int) -> bool:
        return bool(self.leaves) and (
            len(self.leaves) >= MAX_XORB_CHUNKS
            or self.offsets[-1] + HEADER + next_size + 1024 > MAX_XORB_BYTES)

    def add(self, data: bytes | memoryview, leaf: Node, scheme: int | None = None) -> None:
        packed = encode_chunk_auto(data, self.scheme if scheme is None else scheme)
        self.parts.append(packed)
        self.leaves.append(leaf)
        self.offsets.append(self.offsets[-1] + len(packed))

    def hash(self) -> bytes:
        """The xorb's hash: the aggregated hash of its chunks (no final keying)."""
        return merkle_root(self.leaves)

    def serialize(self) -> bytes:
        return b"".join(self.parts)


def chunk_sizes(leaves: Sequence[Node]) -> list[int]:
    return [size for _, size in leaves]
