"""The daemon against `cachecd hub serve` keeping its files in Xet (the default, as the Hub does):
experts read through the content store and proven, the route named by `cachecd status`; a hub
that tampers (`--xet-fault`) refused with nothing stored; `--no-xet` read the LFS way as before.
Deterministic expiries and every tamper kind: tests/faults/test_s18_xet.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachecd.errors import CachecdError
from tests.harness import TINY_REPO, DaemonProcess, LoggedHub, expert_bytes_from_files, run_cli


@pytest.fixture
def served(hub_root: Path, tiny_manifest_path: Path,
           request: pytest.FixtureRequest) -> Iterator[tuple[LoggedHub, DaemonProcess]]:
    """A logged hub with the test's arguments, and a daemon of the tiny model over it."""
    hub = LoggedHub(hub_root, list(getattr(request, "param", [])))
    d = DaemonProcess(hub.url, [tiny_manifest_path])
    try:
        yield hub, d.start()
    finally:
        d.cleanup()
        hub.stop()


def _status(d: DaemonProcess) -> tuple[str, dict]:  # type: ignore[type-arg]
    text = run_cli("status", "--socket", str(d.socket)).stdout
    info = json.loads(run_cli("status", "--json", "--socket", str(d.socket)).stdout)
    return text, info


def test_experts_come_through_xet_proven_and_status_says_so(served, tiny_manifest, tiny_dir):
    hub, d = served
    # Known from its registration on: its layout was checked against headers proven via Xet.
    text, _ = _status(d)
    assert "route     Xet" in text
    layer = tiny_manifest.moe_layers[1]
    with d.client() as c:
        got = c.experts(TINY_REPO, layer, [0, 5, 9])
    for e, data in zip([0, 5, 9], got, strict=True):
        assert data.tobytes() == expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, e))
    paths = [p for _, p, _ in hub.requests()]
    assert any("/reconstructions/" in p for p in paths)
    assert any("/file-chunk-hashes/" in p for p in paths)
    text, info = _status(d)
    assert "route     Xet: each range proven against the Hub's own hash" in text
    assert [m["route"] for m in info["models"]] == ["xet"]
    assert info["upstream"]["xet_windows"] >= 1 and info["upstream"]["xet_proof_bytes"] > 0


@pytest.mark.parametrize("served", [["--no-xet"]], indirect=True)
def test_a_hub_without_xet_is_read_the_lfs_way(served, tiny_manifest, tiny_dir):
    hub, d = served
    layer = tiny_manifest.moe_layers[0]
    with d.client() as c:
        got = c.expert(TINY_REPO, layer, 2)
    assert got.tobytes() == expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, 2))
    assert not any("/reconstructions/" in p for _, p, _ in hub.requests())
    text, info = _status(d)
    assert [m["route"] for m in info["models"]] == ["lfs"]
    assert "route     LFS: exact Range requests" in text


@pytest.mark.parametrize("served", [["--xet-fault", "flip_xorb_byte"],
                                    ["--xet-fault", "proof_node_flip"]], indirect=True)
def test_a_tampering_hub_is_refused_and_nothing_stored(served, tiny_manifest):
    hub, d = served
    layer = tiny_manifest.moe_layers[0]
    with d.client() as c:
        with pytest.raises(CachecdError) as caught:
            c.expert(TINY_REPO, layer, 4)
        assert c.stats()["store"]["entries"] == 0
    assert caught.value.code in ("xet_proof_mismatch", "xet_invalid"), caught.value
    assert "Nothing was stored or served" in caught.value.message
    d.stop()
    fsck = run_cli("fsck", "--cache-dir", str(d.cache_dir))
    assert "corrupt=0" in fsck.stdout, fsck.stdout


@pytest.mark.parametrize(("served", "refused"), [
    (["--xet-fault", "expired_url", "--xet-fault", "times=1"], ("/_xorb/", 403)),
    (["--xet-fault", "expired_token", "--xet-fault", "times=1"], ("/_xet/", 401)),
], indirect=["served"])
def test_an_expired_url_or_token_is_renewed(served, refused, tiny_manifest, tiny_dir):
    hub, d = served
    layer = tiny_manifest.moe_layers[2]
    with d.client() as c:
        got = c.expert(TINY_REPO, layer, 3)
    assert got.tobytes() == expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, 3))
    prefix, status = refused
    seen = [s for _, p, s in hub.requests() if p.startswith(prefix)]
    assert status in seen and seen[-1] in (200, 206), seen
