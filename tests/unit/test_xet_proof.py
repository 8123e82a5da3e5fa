"""Range proofs (/v2/file-chunk-hashes): honest answers verify, and each tamper is refused.

The file's hash is checked against hf_xet.hash_files first, so the proofs are of the hash the
Hub would report. The answers go through JSON as a client receives them.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hf_xet
import pytest

from cachecd.errors import XetProofError
from cachecd.xet import chunking, hashing, proof
from cachecd.xet.hashing import Node
from cachecd.xet.subtree import Subtree, find_stable_end, find_stable_start, merge

DATA = random.Random(3).randbytes(3_000_000)
ENDS = chunking.cut_points(DATA)
LEAVES = hashing.hash_chunks(DATA, ENDS)
FILE_HASH = hashing.file_hash(LEAVES)
N = len(DATA)


def test_the_file_hash_is_hf_xets(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(DATA)
    assert hf_xet.hash_files([str(tmp_path / "f")])[0].hash == hashing.to_hex(FILE_HASH)


def _answer(start: int, end: int) -> dict[str, Any]:
    raw = json.loads(json.dumps(proof.build_answer(LEAVES, N, (start, end))))
    assert isinstance(raw, dict)
    return raw


def _window_leaves(start: int, end: int) -> list[Node]:
    """What a client holding the window's bytes has: the window cut and hashed on its own."""
    data = DATA[start:end]
    return hashing.hash_chunks(data, chunking.cut_points(data))


@pytest.mark.parametrize("want", [(0, 100), (1_000_000, 1_017_547), (N - 10, N), (0, N),
                                  (ENDS[5], ENDS[6])])
def test_honest_proofs_verify(want: tuple[int, int]) -> None:
    answer = _answer(*want)
    start, end = proof.answer_window(answer, *want)
    assert start <= want[0] and want[1] <= end
    proof.verify_window(FILE_HASH, answer, start, _window_leaves(start, end), want=want)


def test_stable_sizes_are_xet_cores() -> None:
    """[2 x min chunk, max chunk - min chunk): 16 KiB to 120 KiB (xorb_object/constants.rs)."""
    assert [proof.is_stable_size(n) for n in (16383, 16384, 122879, 122880)] == [
        False, True, True, False]


def test_the_window_ends_after_two_stable_chunks() -> None:
    """xet-core's rule: widened to chunk bounds, then on until two consecutive chunks both
    have a stable size (16 KiB to 120 KiB)."""
    want = (1_000_000, 1_000_001)
    start, end = proof.answer_window(_answer(*want), *want)
    assert start in [0, *ENDS] and end in ENDS
    sizes = {b: b - a for a, b in zip([0, *ENDS], ENDS, strict=False)}
    first_end = min(e for e in ENDS if e > want[0])
    after = [e for e in ENDS if first_end < e <= end]
    assert len(after) >= 2
    assert proof.is_stable_size(sizes[after[-1]]) and proof.is_stable_size(sizes[after[-2]])
    assert not any(proof.is_stable_size(sizes[a]) and proof.is_stable_size(sizes[b])
                   for a, b in zip(after[:-2], after[1:-1], strict=False))


def _group_ends(nodes: list[Node]) -> set[int]:
    ends, pos = set(), 0
    while pos < len(nodes):
        pos += hashing.next_group(nodes[pos:pos + hashing.MAX_GROUP])
        ends.add(pos)
    return ends


def test_a_stable_start_is_a_group_boundary_whatever_precedes() -> None:
    """xet-core's own check of find_stable_start/_end: random prefixes (suffixes) never move it."""
    rnd = random.Random(9)
    tested = 0
    for _ in range(300):
        nodes = [(rnd.randbytes(32), 1) for _ in range(rnd.randint(15, 60))]
        start, end = find_stable_start(nodes), find_stable_end(nodes)
        for _ in range(20):
            more = [(rnd.randbytes(32), 1) for _ in range(rnd.randint(1, 20))]
            if start is not None:
                assert len(more) + start in _group_ends(more + nodes)
            if end is not None:
                assert end in _group_ends(nodes + more)
        tested += start is not None
    assert tested > 100


def test_subtrees_merge_to_the_root_anywhere() -> None:
    rnd = random.Random(5)
    leaves = [(rnd.randbytes(32), rnd.randint(1, 9999)) for _ in range(700)]
    for _ in range(40):
        a, b = sorted(rnd.sample(range(1, 700), 2))
        parts = [Subtree.from_chunks(True, leaves[:a], False),
                 Subtree.from_chunks(False, leaves[a:b], False),
                 Subtree.from_chunks(False, leaves[b:], True)]
        parts = [Subtree.from_json(json.loads(json.dumps(p.to_json()))) for p in parts]
        assert merge(parts).root() == hashing.merkle_root(leaves)


WANT = (1_000_000, 1_017_547)


def _tampered(edit: Callable[[dict[str, Any]], None]) -> tuple[dict[str, Any], int, int]:
    answer = _answer(*WANT)
    start, end = proof.answer_window(answer, *WANT)
    bad = copy.deepcopy(answer)
    edit(bad)
    return bad, start, end


def _flip_node(answer: dict[str, Any]) -> None:
    node = answer["hashRanges"][0]["nodes"][0]
    node["hash"] = ("1" if node["hash"][0] != "1" else "2") + node["hash"][1:]


def _resize_node(answer: dict[str, Any]) -> None:
    answer["hashRanges"][1]["nodes"][-1]["size"] += 1


def _drop_node(answer: dict[str, Any]) -> None:
    tree = answer["hashRanges"][0]
    tree["nodes"].pop(0)
    tree["levels"][0][0] -= 1 if tree["levels"][0][0] else 0


def _flags(answer: dict[str, Any]) -> None:
    answer["hashRanges"][1]["at_start"] = True


TAMPERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "changed node": _flip_node,
    "changed node size": _resize_node,
    "dropped node": _drop_node,
    "wrong side flags": _flags,
    "swapped gaps": lambda a: a["hashRanges"].reverse(),
    "no gap": lambda a: a["hashRanges"].__setitem__(0, None),
    "bigger file": lambda a: a.__setitem__("fileSize", a["fileSize"] + 1),
    "not json of a tree": lambda a: a["hashRanges"].__setitem__(0, {"nodes": 3}),
}


@pytest.mark.parametrize("name", list(TAMPERS))
def test_a_tampered_proof_is_refused(name: str) -> None:
    bad, start, end = _tampered(TAMPERS[name])
    with pytest.raises(XetProofError):
        proof.verify_window(FILE_HASH, bad, start, _window_leaves(start, end), want=WANT)


def test_a_changed_byte_in_the_window_is_refused() -> None:
    answer = _answer(*WANT)
    start, end = proof.answer_window(answer, *WANT)
    data = bytearray(DATA[start:end])
    data[WANT[0] - start + 5] ^= 1
    leaves = hashing.hash_chunks(bytes(data), chunking.cut_points(bytes(data)))
    with pytest.raises(XetProofError, match="recomputes xet hash"):
        proof.verify_window(FILE_HASH, answer, start, leaves, want=WANT)


def test_a_proof_for_another_offset_is_refused() -> None:
    """Honest for another range: its window is not the one the client holds or asked for."""
    other = _answer(2_000_000, 2_000_100)
    start, end = proof.answer_window(_answer(*WANT), *WANT)
    with pytest.raises(XetProofError, match="does not cover"):
        proof.verify_window(FILE_HASH, other, start, _window_leaves(start, end), want=WANT)
    o_start, o_end = proof.answer_window(other, 2_000_000, 2_000_100)
    # Even without `want`, the window's offset and size must be the held chunks'.
    with pytest.raises(XetProofError):
        proof.verify_window(FILE_HASH, other, start, _window_leaves(start, end))
    # And a gap whose sizes do not add up to the claimed offset is refused.
    shifted = copy.deepcopy(other)
    shifted["windows"][0]["dirtyByteRange"] = [start, start + (o_end - o_start)]
    with pytest.raises(XetProofError):
        proof.verify_window(FILE_HASH, shifted, start, _window_leaves(o_start, o_end))


def test_the_same_bytes_elsewhere_in_the_file_are_refused(tmp_path: Path) -> None:
    """A file holding one run of bytes twice: an honest proof of the second copy, its window
    moved to the first, recomputes the root from the first copy's bytes. Only the gap sizes
    say the proof is of another offset, so the bytes are not proven to be where they were read."""
    rnd = random.Random(17)
    run = rnd.randbytes(600_000)
    data = run + rnd.randbytes(300_001) + run
    leaves = hashing.hash_chunks(data, chunking.cut_points(data))
    name = hashing.file_hash(leaves)
    second = len(data) - len(run)
    want = (second + 300_000, second + 300_100)
    answer = json.loads(json.dumps(proof.build_answer(leaves, len(data), want)))
    start, end = proof.answer_window(answer, *want)
    window = hashing.hash_chunks(data[start:end], chunking.cut_points(data[start:end]))
    proof.verify_window(name, answer, start, window, want=want)
    moved = copy.deepcopy(answer)
    first = start - second
    assert data[first:first + end - start] == data[start:end]
    moved["windows"][0]["dirtyByteRange"] = [first, first + end - start]
    with pytest.raises(XetProofError, match="before the window cover"):
        proof.verify_window(name, moved, first, window, want=(want[0] - second, want[1] - second))


def test_a_window_short_of_the_range_is_refused() -> None:
    answer = _answer(*WANT)
    start, end = proof.answer_window(answer, *WANT)
    short = copy.deepcopy(answer)
    short["windows"][0]["dirtyByteRange"] = [start, WANT[1] - 1]
    with pytest.raises(XetProofError, match="does not cover"):
        proof.verify_window(FILE_HASH, short, start, _window_leaves(start, end), want=WANT)
    with pytest.raises(XetProofError, match="windows"):
        proof.verify_window(FILE_HASH, {**answer, "windows": []}, start,
                            _window_leaves(start, end), want=WANT)


def test_another_files_hash_is_refused() -> None:
    answer = _answer(*WANT)
    start, end = proof.answer_window(answer, *WANT)
    with pytest.raises(XetProofError):
        proof.verify_window(bytes(32), answer, start, _window_leaves(start, end), want=WANT)
