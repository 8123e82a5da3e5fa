"""The data path's frames: the hand-built hit answer is byte for byte the generic encoding."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachecd import protocol
from cachecd.errors import InvalidRequest

_rows = st.lists(
    st.tuples(
        st.integers(0, 1 << 20),
        st.integers(0, 1 << 40),
        st.text("0123456789abcdef", min_size=32, max_size=32),
        st.booleans(),
    ),
    max_size=protocol.MAX_FDS_PER_FRAME,
)


@given(_rows)
def test_encode_experts_matches_encode(rows: list[tuple[int, int, str, bool]]) -> None:
    generic = protocol.encode({"ok": True, "experts": [
        {"expert": e, "size": n, "digest": d, "fetched": f} for e, n, d, f in rows]})
    assert protocol.encode_experts(rows) == generic
    body = generic[protocol.HEADER.size:]
    assert protocol.frame_length(generic[: protocol.HEADER.size]) == len(body)
    assert protocol.decode(body)["experts"] == [
        {"expert": e, "size": n, "digest": d, "fetched": f} for e, n, d, f in rows]


@pytest.mark.parametrize("digest", ['a"b', "ABCD", "", "00\\n"])
def test_a_digest_that_is_not_hex_is_refused(digest: str) -> None:
    with pytest.raises(InvalidRequest):
        protocol.encode_experts([(0, 1, digest, False)])
