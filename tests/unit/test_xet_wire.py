"""The content store's answers as the daemon reads them: v1 and v2 in one form, and the shapes
that are refused before anything is fetched for them."""

from __future__ import annotations

from typing import Any

import pytest

from cachecd.upstream.xet_wire import (
    WireError,
    parse_reconstruction,
    parse_token,
    parse_window,
)

A, B = "a" * 64, "b" * 64


def v2(**over: Any) -> dict[str, Any]:
    doc = {
        "offset_into_first_range": 0,
        "terms": [{"hash": A, "unpacked_length": 300, "range": {"start": 1, "end": 4}},
                  {"hash": B, "unpacked_length": 100, "range": {"start": 0, "end": 1}}],
        "xorbs": {
            A: [{"url": "http://h/x/a?sig=1", "ranges": [
                {"chunks": {"start": 1, "end": 4}, "bytes": {"start": 10, "end": 209}}]}],
            B: [{"url": "http://h/x/b?sig=2", "ranges": [
                {"chunks": {"start": 0, "end": 1}, "bytes": {"start": 0, "end": 49}}]}],
        },
    }
    return doc | over


def test_v2_and_v1_read_alike() -> None:
    rec = parse_reconstruction(v2())
    v1 = {"offset_into_first_range": 0, "terms": v2()["terms"], "fetch_info": {
        A: [{"range": {"start": 1, "end": 4}, "url": "http://h/x/a?sig=1",
             "url_range": {"start": 10, "end": 209}}],
        B: [{"range": {"start": 0, "end": 1}, "url": "http://h/x/b?sig=2",
             "url_range": {"start": 0, "end": 49}}]}}
    assert parse_reconstruction(v1, v1=True) == rec
    assert [(t.xorb, t.start, t.end, t.unpacked) for t in rec.terms] == [(A, 1, 4, 300),
                                                                      (B, 0, 1, 100)]
    assert rec.fetches[0].ranges[0].length == 200


@pytest.mark.parametrize("bad", [
    {"terms": []},
    {"terms": [{"hash": "A" * 64, "unpacked_length": 1, "range": {"start": 0, "end": 1}}]},
    {"terms": [{"hash": A, "unpacked_length": 1, "range": {"start": 3, "end": 3}}]},
    {"terms": [{"hash": A, "unpacked_length": 1, "range": {"start": 0, "end": 9}}]},  # unfetched
    {"xorbs": {A: [{"url": "file:///etc/passwd", "ranges": [
        {"chunks": {"start": 1, "end": 4}, "bytes": {"start": 0, "end": 9}}]}]}},
    {"offset_into_first_range": -1},
])
def test_malformed_reconstructions_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(WireError):
        parse_reconstruction(v2(**bad))


def window(w0: int, w1: int, size: int = 1000) -> dict[str, Any]:
    return {"totalChunks": 9, "fileSize": size, "windows": [{"dirtyByteRange": [w0, w1]}],
            "hashRanges": [None, None], "gapVerification": []}


def test_a_window_must_hold_the_range_within_the_slack() -> None:
    assert parse_window(window(100, 400), 150, 300, size=1000, slack=1000).start == 100
    for doc, why in [(window(160, 400), "does not hold"), (window(100, 290), "does not hold"),
                     (window(0, 1000), "adds"), (window(100, 400, size=999), "fileSize")]:
        with pytest.raises(WireError, match=why):
            parse_window(doc, 150, 300, size=1000, slack=500)


def test_token_answer() -> None:
    tok = parse_token({"accessToken": "xet_1", "exp": 1_900_000_000, "casUrl": "http://cas/"})
    assert (tok.cas_url, tok.exp) == ("http://cas", 1.9e9)
    with pytest.raises(WireError):
        parse_token({"accessToken": "", "exp": 1, "casUrl": "http://cas"})
