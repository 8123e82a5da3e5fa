"""Scenario 12: path traversal. Hypothesis drives repo parts, layers, experts, revisions and file
names through the HTTP routes, the data path and manifest registration. Every answer is a typed
4xx (invalid_request, repo_not_allowed, not_found...; manifest_invalid for a manifest) and the
hub sees no request at all. A symlink planted at a blob path or in tmp/ is never followed."""

from __future__ import annotations

import io
import json
import socket
from urllib.parse import quote

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachecd import protocol
from tests.faults.figures import FIGURES
from tests.faults.support import (
    Model,
    check_wire_error,
    fetch_verified,
    files_under,
    http_request,
)

NASTY = ["..", "../x", "a/../../etc", "/etc/passwd", "C:\\x", "\\\\host\\share", "%2e%2e/",
         "%2e%2e%2f", "\x00", "a\x00b", "--", "-", ".", "~", "x" * 300, "faults/../small",
         "ORG", "main", "0" * 39, "g" * 40, "\u202e", " ", "a b", "?", "#", "*"]
part = st.one_of(st.sampled_from(NASTY), st.text(min_size=0, max_size=40),
                 st.builds(lambda a, b: a + b, st.sampled_from(NASTY), st.text(max_size=8)))
number = st.one_of(st.sampled_from(["-1", "2**64", str(2**64), "1e3", "0x1", "", " 1", "¹"]),
                   st.text(max_size=12))
TYPED_4XX = {400, 403, 404, 405, 413, 422}
SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def setup(small: Model, module_pool):  # type: ignore[no-untyped-def]
    hub = module_pool.hub(small)
    return hub, module_pool.daemon(hub, [small])


def _number(text: str) -> bool:
    try:
        return 0 <= int(text) < 1 << 20
    except ValueError:
        return False


def _typed(status: int, body: bytes) -> str:
    assert status in TYPED_4XX, (status, body[:300])
    return str(check_wire_error(status, body)["error"])


@SETTINGS
@given(org=part, name=part, layer=number, expert=number)
def test_http_routes_refuse_before_any_io(setup, org: str, name: str, layer: str, expert: str) -> None:  # type: ignore[no-untyped-def]
    hub, d = setup
    if (org, name) == ("faults", "small") or (_number(layer) and _number(expert)):
        return  # a real request for a real expert (int() reads " 1" and "+1" as 1)
    hub.clear_records()
    q = [quote(x, safe="") for x in (org, name, layer, expert)]
    base = f"/v1/models/{q[0]}/{q[1]}"
    codes = set()
    for method, path, body in (
        ("GET", base, None),
        ("GET", f"{base}/experts/{q[2]}/{q[3]}", None),
        ("GET", f"{base}/experts/{q[2]}?ids={q[3]}", None),
        ("POST", f"{base}/prefetch", json.dumps({"layer": layer, "ids": [expert]}).encode()),
        ("GET", f"/v1/models/faults/small/experts/{q[2]}/{q[3]}", None),
    ):
        status, _, data = http_request(d.socket, method, path, body,
                                       {"Content-Type": "application/json"} if body else None)
        codes.add(_typed(status, data))
        FIGURES.add("s12.http_requests_fuzzed")
    assert hub.count() == 0
    assert codes <= {"invalid_request", "repo_not_allowed", "not_found", "model_not_found",
                     "expert_not_found"}, codes


@SETTINGS
@given(model=st.builds(lambda a, b: f"{a}/{b}", part, part) | part,
       layer=st.one_of(st.integers(), st.text(max_size=5), st.none(), st.floats()),
       ids=st.lists(st.one_of(st.integers(), st.text(max_size=5)), max_size=5))
def test_data_path_refuses_before_any_io(setup, model: str, layer, ids) -> None:  # type: ignore[no-untyped-def]
    hub, d = setup
    if model == "faults/small" and isinstance(layer, int) and all(isinstance(i, int) for i in ids):
        return  # a real request
    hub.clear_records()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(d.socket) + ".data")
        s.sendall(protocol.encode({"op": "experts", "model": model, "layer": layer, "ids": ids}))
        msg, fds, _, _ = socket.recv_fds(s, protocol.MAX_FRAME, 8)
    assert not fds
    answer = protocol.decode(msg[protocol.HEADER.size:])
    assert answer["ok"] is False and answer["error"] in {
        "invalid_request", "repo_not_allowed", "expert_not_found", "not_found"}, answer
    assert hub.count() == 0
    FIGURES.add("s12.data_frames_fuzzed")


def _with_meta(model: Model, field: str, value: str) -> bytes:
    raw = model.manifest_path.read_bytes()
    with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    meta = json.loads(arrays.pop("meta").tobytes())
    if field == "file":
        meta["files"][0][0] = value
    else:
        meta[field] = value
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    return buf.getvalue()


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["repo", "revision", "file"]), value=part)
def test_manifests_with_nasty_names_are_refused(setup, small: Model, field: str, value: str) -> None:  # type: ignore[no-untyped-def]
    hub, d = setup
    hub.clear_records()
    before = set(files_under(d.base))
    status, _, data = http_request(d.socket, "POST", "/v1/models", _with_meta(small, field, value),
                                   {"Content-Type": "application/octet-stream"})
    FIGURES.add("s12.manifests_fuzzed")
    if status == 201:  # only a harmless file name can pass; it is a name, never a local path
        assert field == "file", (field, value, data[:200])
        created = set(files_under(d.base)) - before
        assert all(p.parent == d.base / "models" / "manifests" for p in created), created
        FIGURES.add("s12.manifests_with_odd_but_safe_names_accepted")
        restore = small.manifest_path.read_bytes()
        status, _, _ = http_request(d.socket, "POST", "/v1/models", restore,
                                    {"Content-Type": "application/octet-stream"})
        assert status == 201
        return
    assert _typed(status, data) == "manifest_invalid"
    assert set(files_under(d.base)) - before <= {p for p in files_under(d.base / "cache")}
    assert hub.count() == 0


def test_symlink_at_blob_path_and_in_tmp_is_not_followed(setup, small: Model) -> None:  # type: ignore[no-untyped-def]
    hub, d = setup
    victim = d.base / "victim"
    victim.write_bytes(b"precious")
    layer = small.layers[0]
    entry = small.entry(layer, 4)
    with d.client() as c:
        fetch_verified(c, small, layer, [4])
        c.stats()  # answers once the commit is done: the blob is in place
        blob = d.cache_dir / "blobs" / entry.digest_hex[:2] / entry.digest_hex
        blob.unlink()
        blob.symlink_to(victim)
        fetch_verified(c, small, layer, [4])  # refused (O_NOFOLLOW), dropped, fetched again
    followed = int(victim.read_bytes() != b"precious")
    assert not blob.is_symlink() and not followed
    assert d.stop() == 0
    (d.cache_dir / "tmp" / "planted").symlink_to(victim)
    d.start()
    assert not (d.cache_dir / "tmp" / "planted").is_symlink()
    followed += int(victim.read_bytes() != b"precious" or not victim.exists())
    assert not followed
    FIGURES.set("s12.planted_symlinks_followed", followed)
