"""Chunk cuts and file hashes against the reference client: hf_xet.hash_files (hf-xet 1.8).

hf_xet gives no chunk boundaries, only file hashes; a hash agrees only if every cut, every chunk
hash and the tree's grouping agree, so each file below checks the three together. The files
cover the edges: empty, one byte, under the minimum chunk, random megabytes (cuts by the mask,
a tree of several levels), zero runs (cuts forced at the maximum) and runs of a short pattern.
"""

from __future__ import annotations

import random
from pathlib import Path

import hf_xet
import numpy as np
import pytest

from cachecd.errors import XetFormatError
from cachecd.xet import chunking, hashing


def _mask_hit() -> bytes:
    """64 bytes whose gear hash passes the mask (so a chunk can end on their last byte)."""
    data = np.frombuffer(random.Random(45).randbytes(1 << 20), dtype=np.uint8)
    hits = np.flatnonzero((chunking._window_hashes(data, data[:0]) & np.uint64(chunking.MASK))
                          == 0)
    end = int(hits[hits >= 63][0])
    return data[end - 63:end + 1].tobytes()


def _files() -> dict[str, bytes]:
    rnd = random.Random(44)
    rand = rnd.randbytes
    hit = _mask_hit()
    return {
        # A mask hit on the minimum chunk's last byte cuts there; one a byte earlier does not.
        "cut_at_min": rand(chunking.MIN_CHUNK - 64) + hit + rand(50_000),
        "hit_before_min": rand(chunking.MIN_CHUNK - 65) + hit + rand(50_000),
        "empty": b"",
        "one_byte": b"\x07",
        "under_min": rand(5000),
        "exactly_min": rand(chunking.MIN_CHUNK),
        "random_3mb": rand(3_000_000),
        "zero_runs": bytes(700_000) + rand(300_000) + bytes(1_000_001) + rand(9),
        "pattern": b"abcdefgh" * 200_000 + rand(70_000),
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("xetfiles")
    paths = []
    for name, data in _files().items():
        (folder / name).write_bytes(data)
        paths.append(str(folder / name))
    infos = hf_xet.hash_files(paths)
    return {Path(p).name: info.hash for p, info in zip(paths, infos, strict=True)}


@pytest.mark.parametrize("name", list(_files()))
def test_file_hash_equals_hf_xet(name: str, reference: dict[str, str]) -> None:
    data = _files()[name]
    leaves = hashing.hash_chunks(data, chunking.cut_points(data))
    assert hashing.to_hex(hashing.file_hash(leaves)) == reference[name]


def test_the_minimum_chunk_is_inclusive() -> None:
    assert chunking.cut_points(_files()["cut_at_min"])[0] == chunking.MIN_CHUNK
    assert chunking.cut_points(_files()["hit_before_min"])[0] != chunking.MIN_CHUNK - 1


def test_cuts_keep_the_size_bounds() -> None:
    data = _files()["zero_runs"]
    ends = chunking.cut_points(data)
    sizes = [b - a for a, b in zip([0, *ends], ends, strict=False)]
    assert ends[-1] == len(data)
    assert all(chunking.MIN_CHUNK <= s <= chunking.MAX_CHUNK for s in sizes[:-1])
    assert sizes.count(chunking.MAX_CHUNK) >= 10  # the zero runs: no mask hit, forced cuts


def test_cuts_do_not_depend_on_numpy_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The window reaches back across the vectorised blocks: tiny blocks give the same cuts."""
    data = _files()["random_3mb"]
    whole = chunking.cut_points(data)
    monkeypatch.setattr(chunking, "_BLOCK", 4099)
    assert chunking.cut_points(data) == whole


def test_a_tree_of_several_levels() -> None:
    """~46 chunks group into more than one level: the root is not one node over the leaves."""
    data = _files()["random_3mb"]
    leaves = hashing.hash_chunks(data, chunking.cut_points(data))
    assert len(hashing.collapse_level(leaves)) > 1


def test_hex_form_is_little_endian_words() -> None:
    raw = bytes(range(32))
    # The spec's example (docs/xet/api.md), whose printed string drops two digits of word 3.
    text = "0706050403020100" "0f0e0d0c0b0a0908" "1716151413121110" "1f1e1d1c1b1a1918"
    assert hashing.to_hex(raw) == text
    assert hashing.from_hex(text) == raw
    with pytest.raises(XetFormatError):
        hashing.from_hex("zz" * 32)
    with pytest.raises(XetFormatError):
        hashing.from_hex("00" * 31)
