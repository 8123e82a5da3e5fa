"""`cachecd hub serve` speaks Xet as the Hub does, checked with the real clients: hf_xet's
download_stream and huggingface_hub's downloads (which use hf-xet when the Hub says X-Xet-Hash),
byte-identical; file hashes equal hf_xet.hash_files; tokens and signed xorb URLs expire; the
proof endpoint's answers verify, and the fault knobs break what they say they break."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import hf_xet
import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download

from cachecd.errors import XetFormatError, XetProofError
from cachecd.lanhub.app import HUB_KEY
from cachecd.lanhub.server import HubServer, spawn_hub
from cachecd.lanhub.xet_routes import XetSide
from cachecd.xet import chunking, hashing, proof, xorb

REPO = "acme/xet"
DATA = random.Random(11).randbytes(2_500_000) + bytes(700_000) + random.Random(12).randbytes(9)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("xethub")
    repo = root / REPO
    repo.mkdir(parents=True)
    (repo / "big.bin").write_bytes(DATA)
    (repo / "model.safetensors").write_bytes(random.Random(13).randbytes(300_000))
    (repo / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    return root


@pytest.fixture(scope="module")
def reference(root: Path) -> dict[str, str]:
    paths = [root / REPO / n for n in ("big.bin", "model.safetensors")]
    return {p.name: i.hash for p, i in zip(paths, hf_xet.hash_files([str(p) for p in paths]),
                                            strict=True)}


@pytest.fixture(scope="module")
def hub(root: Path) -> Iterator[str]:
    proc, url = spawn_hub(root, verbose=True)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _request(url: str, method: str = "GET", headers: dict[str, str] | None = None
             ) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=60)
    conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""),
                 headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


def _xet(url: str, name: str = "big.bin") -> tuple[str, dict[str, Any]]:
    """(xet hash, token answer) as a client learns them: HEAD /resolve, then the refresh route."""
    status, head, _ = _request(f"{url}/{REPO}/resolve/main/{name}", "HEAD")
    assert status == 302
    _, _, body = _request(head["x-xet-refresh-route"])
    return head["x-xet-hash"], json.loads(body)


def _group(token: dict[str, Any]) -> Any:
    return hf_xet.XetSession().new_download_stream_group(
        endpoint=token["casUrl"], token=token["accessToken"], token_expiry_unix_secs=token["exp"])


def test_hashes_are_hf_xets_on_resolve_tree_and_paths_info(hub: str,
                                                           reference: dict[str, str]) -> None:
    status, head, _ = _request(f"{hub}/{REPO}/resolve/main/big.bin", "HEAD")
    assert status == 302 and head["x-xet-hash"] == reference["big.bin"]
    assert head["x-xet-refresh-route"] in head["link"] and 'rel="xet-auth"' in head["link"]
    assert "/_cdn/" in head["location"]  # the LFS-compatible route is kept
    api = HfApi(endpoint=hub)
    tree = {f.path: f for f in api.list_repo_tree(REPO, recursive=True)}
    assert tree["big.bin"].xet_hash == reference["big.bin"]  # type: ignore[union-attr]
    assert tree["model.safetensors"].xet_hash == reference["model.safetensors"]  # type: ignore[union-attr]
    assert tree["config.json"].xet_hash is None  # type: ignore[union-attr]  # kept in git
    info = api.get_paths_info(REPO, ["big.bin", "config.json"])
    assert {f.path: f.xet_hash for f in info} == {"big.bin": reference["big.bin"],  # type: ignore[union-attr]
                                                  "config.json": None}
    _, head, _ = _request(f"{hub}/{REPO}/resolve/main/config.json", "HEAD")
    assert "x-xet-hash" not in head


def test_token_answer_has_body_and_headers(hub: str) -> None:
    _, head, _ = _request(f"{hub}/{REPO}/resolve/main/big.bin", "HEAD")
    status, headers, body = _request(head["x-xet-refresh-route"])
    token = json.loads(body)
    assert status == 200 and set(token) == {"accessToken", "exp", "casUrl"}
    assert headers["x-xet-access-token"] == token["accessToken"]
    assert headers["x-xet-cas-url"] == token["casUrl"] == f"{hub}/_xet"
    assert int(headers["x-xet-token-expiration"]) == token["exp"]


@pytest.mark.parametrize("span", [(None, None), (0, 1), (1_000_003, 3_100_000),
                                  (len(DATA) - 5, len(DATA)), (2_600_000, 2_600_001)])
def test_hf_xet_download_stream_is_byte_identical(hub: str, span: tuple[int | None, int | None]
                                                  ) -> None:
    xet_hash, token = _xet(hub)
    start, end = span
    got = b"".join(_group(token).download_stream(hf_xet.XetFileInfo(xet_hash, len(DATA)),
                                                 start, end))
    assert got == DATA[start:end]


def test_hf_xet_refreshes_its_token_from_the_route(hub: str) -> None:
    xet_hash, token = _xet(hub)
    _, head, _ = _request(f"{hub}/{REPO}/resolve/main/big.bin", "HEAD")
    group = hf_xet.XetSession().new_download_stream_group(
        token_refresh_url=head["x-xet-refresh-route"])
    assert b"".join(group.download_stream(hf_xet.XetFileInfo(xet_hash, len(DATA)))) == DATA


def test_huggingface_hub_downloads_through_xet(root: Path, tmp_path: Path) -> None:
    """The hub as a subprocess with its access log (-v) in a file: the large files came
    through the CAS and xorbs, never as a GET of the LFS route."""
    log_path = tmp_path / "hub.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "cachecd.cli", "-v", "hub", "serve",
                                 str(root)], stdout=subprocess.PIPE, stderr=log_file, text=True)
    try:
        assert proc.stdout is not None
        hub = proc.stdout.readline().strip().rsplit(" at ", 1)[1]
        got = hf_hub_download(REPO, "big.bin", endpoint=hub, cache_dir=tmp_path / "one")
        assert Path(got).read_bytes() == DATA
        snap = Path(snapshot_download(REPO, endpoint=hub, cache_dir=tmp_path / "all"))
        for name in ("big.bin", "model.safetensors", "config.json"):
            assert (snap / name).read_bytes() == (root / REPO / name).read_bytes()
    finally:
        proc.terminate()
        proc.wait(30)
    log = log_path.read_text()
    assert "path=/_xorb/" in log and "path=/_xet/v2/reconstructions/" in log
    assert not any("method=GET path=/_cdn/" in line and ("big.bin" in line or
                   "model.safetensors" in line) for line in log.splitlines())


def test_no_xet_serves_the_lfs_route_only(root: Path, tmp_path: Path) -> None:
    proc, url = spawn_hub(root, extra_args=["--no-xet"])
    try:
        _, head, _ = _request(f"{url}/{REPO}/resolve/main/big.bin", "HEAD")
        assert "x-xet-hash" not in head and "link" not in head
        status, _, _ = _request(f"{url}/api/models/{REPO}/xet-read-token/main")
        assert status == 404
        got = hf_hub_download(REPO, "big.bin", endpoint=url, cache_dir=tmp_path)
        assert Path(got).read_bytes() == DATA
    finally:
        proc.terminate()
        proc.wait(30)


def test_fault_flags_on_the_command_line(root: Path) -> None:
    bad = subprocess.run([sys.executable, "-m", "cachecd.cli", "hub", "serve", str(root),
                          "--xet-fault", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown xet fault 'nope'" in bad.stderr
    proc, url = spawn_hub(root, extra_args=["--xet-fault", "proof_node_flip",
                                            "--xet-token-ttl", "120"])
    try:
        xet_hash, token = _xet(url)
        assert token["exp"] <= time.time() + 121
        want = (0, 1000)
        answer = _proof(token, xet_hash, *want)
        start, end = proof.answer_window(answer, *want)
        leaves = _window_leaves(url, xet_hash, token, start, end)
        with pytest.raises(XetProofError):
            proof.verify_window(hashing.from_hex(xet_hash), answer, start, leaves, want=want)
    finally:
        proc.terminate()
        proc.wait(30)


# ---------------------------------------------------------------- in process: expiry and knobs


@contextmanager
def _hub_in_process(root: Path, **options: Any) -> Iterator[tuple[str, XetSide]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = HubServer(root, **options)
    try:
        url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
        side = server.app[HUB_KEY].xet
        assert side is not None
        yield url, side
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def _reconstruction(url: str, xet_hash: str, token: dict[str, Any],
                    rng: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token['accessToken']}"}
    if rng:
        headers["Range"] = rng
    status, _, body = _request(f"{token['casUrl']}/v2/reconstructions/{xet_hash}", headers=headers)
    assert status == 200, body
    return json.loads(body)


def _fetch(entry: dict[str, Any]) -> tuple[int, bytes]:
    rng = entry["ranges"][0]["bytes"]
    status, _, body = _request(entry["url"], headers={"Range": f"bytes={rng['start']}-{rng['end']}"})
    return status, body


def test_expired_url_is_403_expired_token_401(root: Path) -> None:
    with _hub_in_process(root, xet_url_ttl_s=-1) as (url, side):
        xet_hash, token = _xet(url)
        recon = _reconstruction(url, xet_hash, token)
        entry = next(iter(recon["xorbs"].values()))[0]
        assert _fetch(entry)[0] == 403
        assert side.faults.counts["xorb_expired"] == 1
        side.url_ttl_s = 3600
        entry = next(iter(_reconstruction(url, xet_hash, token)["xorbs"].values()))[0]
        status, body = _fetch(entry)
        assert status == 206 and xorb.decode_chunks(body)[0] == DATA[:len(xorb.decode_chunks(body)[0])]
        # A range other than the signed one is refused too.
        lo = entry["ranges"][0]["bytes"]["start"]
        status, _, _ = _request(entry["url"], headers={"Range": f"bytes={lo}-{lo + 10**9}"})
        assert status == 403
        # The knobs: N answers spoiled, then honest ones (what a recovering client meets).
        side.faults.expired_url, side.faults.times = True, 1
        entry = next(iter(_reconstruction(url, xet_hash, token)["xorbs"].values()))[0]
        assert _fetch(entry)[0] == 403
        entry = next(iter(_reconstruction(url, xet_hash, token)["xorbs"].values()))[0]
        assert _fetch(entry)[0] == 206
        side.faults.expired_url = False
        side.faults.expired_token, side.faults.times = True, 1
        _, stale = _xet(url)
        status, _, _ = _request(f"{stale['casUrl']}/v2/reconstructions/{xet_hash}",
                                headers={"Authorization": f"Bearer {stale['accessToken']}"})
        assert status == 401
        _, fresh = _xet(url)
        assert _reconstruction(url, xet_hash, fresh)["terms"]
        side.token_ttl_s = -1
        _, stale = _xet(url)
        status, _, _ = _request(f"{stale['casUrl']}/v2/reconstructions/{xet_hash}",
                                headers={"Authorization": f"Bearer {stale['accessToken']}"})
        assert status == 401


def test_v1_and_ranges(root: Path) -> None:
    with _hub_in_process(root) as (url, _side):
        xet_hash, token = _xet(url)
        auth = {"Authorization": f"Bearer {token['accessToken']}", "Range": "bytes=100000-199999"}
        status, _, body = _request(f"{token['casUrl']}/v1/reconstructions/{xet_hash}",
                                   headers=auth)
        v1 = json.loads(body)
        assert status == 200 and v1["fetch_info"] and v1["offset_into_first_range"] > 0
        status, _, _ = _request(f"{token['casUrl']}/v2/reconstructions/{xet_hash}",
                                headers={**auth, "Range": f"bytes={len(DATA)}-"})
        assert status == 416


def _window_leaves(url: str, xet_hash: str, token: dict[str, Any],
                   start: int, end: int) -> list[hashing.Node]:
    data = b"".join(_group(token).download_stream(hf_xet.XetFileInfo(xet_hash, len(DATA)),
                                                  start, end))
    return hashing.hash_chunks(data, chunking.cut_points(data))


def _proof(token: dict[str, Any], xet_hash: str, a: int, b: int) -> dict[str, Any]:
    status, _, body = _request(f"{token['casUrl']}/v2/file-chunk-hashes/{xet_hash}", headers={
        "Authorization": f"Bearer {token['accessToken']}", "X-Range-Dirty": f"bytes={a}-{b - 1}"})
    assert status == 200, body
    return json.loads(body)


def test_file_chunk_hashes_prove_a_range_and_the_proof_knobs(root: Path) -> None:
    want = (1_200_000, 1_300_000)
    with _hub_in_process(root) as (url, side):
        xet_hash, token = _xet(url)
        answer = _proof(token, xet_hash, *want)
        start, end = proof.answer_window(answer, *want)
        leaves = _window_leaves(url, xet_hash, token, start, end)
        proof.verify_window(hashing.from_hex(xet_hash), answer, start, leaves, want=want)
        side.faults.proof_node_flip = True
        with pytest.raises(XetProofError):
            proof.verify_window(hashing.from_hex(xet_hash), _proof(token, xet_hash, *want),
                                start, leaves, want=want)
        side.faults.proof_node_flip = False
        side.faults.proof_offset = 500_000
        with pytest.raises(XetProofError):
            proof.verify_window(hashing.from_hex(xet_hash), _proof(token, xet_hash, *want),
                                start, leaves, want=want)


def test_byte_knobs_spoil_what_they_say(root: Path) -> None:
    with _hub_in_process(root, xet_scheme="mixed", xorb_bytes=512 * 1024) as (url, side):
        xet_hash, token = _xet(url)
        recon = _reconstruction(url, xet_hash, token)
        assert len(recon["terms"]) >= 3  # several xorbs: a swap is possible
        entry = recon["xorbs"][recon["terms"][0]["hash"]][0]
        good = xorb.decode_chunks(_fetch(entry)[1])
        assert b"".join(good) == DATA[:sum(map(len, good))]
        side.faults.flip_xorb_byte, side.faults.times = True, 1
        assert b"".join(xorb.decode_chunks(_fetch(entry)[1])) != b"".join(good)
        assert xorb.decode_chunks(_fetch(entry)[1]) == good  # times=1: once only
        side.faults.flip_xorb_byte = False
        side.faults.bad_chunk_header, side.faults.times = True, 1
        with pytest.raises(XetFormatError):
            xorb.decode_chunks(_fetch(entry)[1])
        side.faults.bad_chunk_header = False
        side.faults.swap_xorb, side.faults.times = True, None
        swapped = _reconstruction(url, xet_hash, token)
        assert [t["hash"] for t in swapped["terms"][:2]] == [t["hash"] for t in
                                                             recon["terms"][1::-1]]
        got = b"".join(_group(token).download_stream(hf_xet.XetFileInfo(xet_hash, len(DATA))))
        assert got != DATA  # the real client does not check: the daemon must
