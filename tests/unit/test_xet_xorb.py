"""Xorb chunks: each compression scheme round trips, and fetched ranges are parsed with bounds."""

from __future__ import annotations

import random

import pytest

from cachecd.errors import XetFormatError
from cachecd.xet import chunking, xorb

RND = random.Random(7)
SAMPLES = [b"", b"\x01", b"abc", bytes(4097), RND.randbytes(65_537),
           bytes(range(256)) * 512, RND.randbytes(chunking.MAX_CHUNK)]


@pytest.mark.parametrize("scheme", xorb.SCHEMES)
@pytest.mark.parametrize("index", range(len(SAMPLES)))
def test_each_scheme_round_trips(scheme: int, index: int) -> None:
    data = SAMPLES[index]
    packed = xorb.encode_chunk(data, scheme)
    assert packed[4] == scheme and int.from_bytes(packed[5:8], "little") == len(data)
    assert xorb.decode_chunks(packed, expect=1) == [data]


def test_byte_grouping_follows_the_spec() -> None:
    assert xorb.group4(bytes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])) == bytes([1, 5, 9, 2, 6, 10, 3, 7, 4, 8])


def test_a_range_of_several_chunks_in_order() -> None:
    parts = [xorb.encode_chunk(s, i % 3) for i, s in enumerate(SAMPLES)]
    assert xorb.decode_chunks(b"".join(parts)) == SAMPLES
    with pytest.raises(XetFormatError, match="more than"):
        xorb.decode_chunks(b"".join(parts), expect=2)
    with pytest.raises(XetFormatError, match="chunks, 9 expected"):
        xorb.decode_chunks(b"".join(parts), expect=9)


def _bad(packed: bytes, at: int, value: int) -> bytes:
    out = bytearray(packed)
    out[at] = value
    return bytes(out)


def test_malformed_headers_raise_a_typed_error() -> None:
    good = xorb.encode_chunk(RND.randbytes(20_000), xorb.LZ4)
    cases = {
        "cut short": good[:5],
        "payload cut": good[:-1],
        "version": _bad(good, 0, 1),
        "scheme": _bad(good, 4, 9),
        "huge size": _bad(good, 7, 0xFF),  # uncompressed size past 128 KiB
        "size lies": _bad(good, 5, good[5] ^ 1),  # LZ4 decodes to another length
        "garbage payload": good[:8] + bytes(len(good) - 8),
    }
    for name, buf in cases.items():
        with pytest.raises(XetFormatError):
            xorb.decode_chunks(buf)
        assert name  # each case named for a failing run's report


def test_builder_offsets_and_hash() -> None:
    from cachecd.xet import hashing

    builder = xorb.XorbBuilder(scheme=xorb.LZ4)
    chunks = [RND.randbytes(9000), bytes(30_000), RND.randbytes(100)]
    for c in chunks:
        builder.add(c, (hashing.chunk_hash(c), len(c)))
    blob = builder.serialize()
    assert builder.offsets[-1] == len(blob)
    assert xorb.decode_chunks(blob[builder.offsets[1]:builder.offsets[3]], expect=2) == chunks[1:]
    assert builder.hash() == hashing.merkle_root(builder.leaves)
    assert blob[builder.offsets[1] + 4] == xorb.LZ4  # zeros shrink: kept compressed
    assert blob[4] == xorb.NONE  # random bytes do not: stored as they are
