"""JSON from outside is parsed within bounds (``cachecd.manifest.bounds``): the nesting count
sees brackets as the parser does (not inside strings, escapes honoured), and bad input of any
shape is ``ManifestInvalid`` naming the file and the field, never a RecursionError."""

from __future__ import annotations

import json

import pytest

from cachecd.errors import ManifestInvalid
from cachecd.manifest.bounds import MAX_DEPTH, loads, nesting_depth


@pytest.mark.parametrize("text, depth", [
    ('{"a": [1, {"b": "[[[[{{"}]}', 3),
    (r'["a\"[[[", 1]', 1),
    (r'["\\", [[]]]', 3),  # an escaped backslash, then the string's closing quote
    (r'["\\\"[", [[]]]', 3),
    ("1", 0),
])
def test_depth_counts_what_the_parser_nests(text: str, depth: int) -> None:
    assert nesting_depth(text.encode()) == depth
    json.loads(text)  # each is JSON


def test_nested_past_the_limit_is_refused_naming_file_and_field() -> None:
    ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads(ok.encode(), "f", "meta") == json.loads(ok)
    for bad in (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), b"[" * 10**6,
                b'{"a":' * 10**5):
        with pytest.raises(ManifestInvalid, match=r"^f\.manifest: meta: JSON nested \d+ deep"):
            loads(bad, "f.manifest", "meta")


def test_other_encodings_and_sizes_are_refused() -> None:
    with pytest.raises(ManifestInvalid, match="meta: not UTF-8"):
        loads('["x"]'.encode("utf-16"), "f", "meta")
    with pytest.raises(ManifestInvalid, match="over the 4-byte limit"):
        loads(b"[1,2]", "f", "meta", max_bytes=4)
    with pytest.raises(ManifestInvalid, match="meta: bad JSON"):
        loads(b"[1,", "f", "meta")
