"""The data path's frames: the hand-built hit answer is byte for byte the generic encoding."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cachecd import protocol

_rows = st.lists(
    st.tuples(
        st.integers(0, 1 << 20),
        st.integers(0, 1 << 40),
        st.booleans(),
    ),
    max_size=protocol.MAX_FDS_PER_FRAME,
)


@given(_rows)
def test_encode_experts_matches_encode(rows: list[tuple[int, int, bool]]) -> None:
    generic = protocol.encode({"ok": True, "experts": [
        {"expert": e, "size": n, "fetched": f} for e, n, f in rows]})
    assert protocol.encode_experts(rows) == generic
    body = generic[protocol.HEADER.size:]
    assert protocol.frame_length(generic[: protocol.HEADER.size]) == len(body)
    assert protocol.decode(body)["experts"] == [
        {"expert": e, "size": n, "fetched": f} for e, n, f in rows]
