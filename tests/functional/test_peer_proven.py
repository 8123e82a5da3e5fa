"""A peer's answer is proven like the Hub's (issue 44): a token holder that answers `/v2/blobs` by
digest alone, with another expert's bytes that hash to the digest an untrusted manifest gives, can
no longer make that blob stand for an expert it is not. The receiver is a real daemon reading the
real `cachecd hub serve` through Xet; the lying peer is a plain HTTP server speaking the share's
protocol (the network edge). The receiver proves the peer's bytes against the content store's
proof for the expert's own range, refuses them, asks the Hub, and refuses the manifest's word
(`manifest_mismatch`): nothing of the other expert is stored or served as this one."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cachecd.errors import ManifestMismatch
from tests import tampered
from tests.harness import TINY_REPO, DaemonProcess, HubProcess, expert_bytes_from_files, short_tmp


class _DigestOnly(BaseHTTPRequestHandler):
    """Answers every digest it holds, whatever source key is asked: a peer's word alone."""

    blobs: dict[str, bytes] = {}
    asked: list[dict[str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).asked.extend(asked)
        bodies = [self.blobs.get(a["digest"], b"") for a in asked]
        self.send_response(200)
        self.send_header("X-Cachecd-Sizes", ",".join(str(len(b)) for b in bodies))
        self.send_header("Content-Length", str(sum(len(b) for b in bodies)))
        self.end_headers()
        for body in bodies:
            self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def liar() -> Iterator[tuple[str, type[_DigestOnly]]]:
    handler = type("Liar", (_DigestOnly,), {"blobs": {}, "asked": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_a_peer_answering_by_digest_alone_cannot_alias_an_expert(
        liar: tuple[str, Any], hub: HubProcess, tiny_manifest_path: Path, tiny_manifest: Any,
        tiny_dir: Path, tmp_path: Path) -> None:
    url, handler = liar
    layer = tiny_manifest.moe_layers[1]
    owner = tiny_manifest.expert(layer, 1)
    # An untrusted manifest gives (L, 0) the digest of (L, 1); the peer holds (L, 1)'s bytes.
    bad = tampered.alias_digests(tiny_manifest_path, tmp_path / "alias.manifest",
                                 {tiny_manifest.row(layer, 0): tiny_manifest.row(layer, 1)})
    handler.blobs[owner.digest_hex] = expert_bytes_from_files(tiny_dir, owner)
    token = short_tmp("cdtok") / "token"
    token.write_text("s3cret-token-for-tests-only-0123456789\n")
    token.chmod(0o600)
    b = DaemonProcess(hub.url, [bad], args=["--peer", url, "--peer-token-file", str(token)])
    b.start()
    try:
        with b.client() as c:
            with pytest.raises(ManifestMismatch) as info:
                got = c.expert(TINY_REPO, layer, 0).tobytes()
                assert got != expert_bytes_from_files(tiny_dir, owner), \
                    "the peer's bytes of (L, 1) were stored and served as (L, 0)"
            assert f"layer={layer} expert=0" in info.value.message
            assert c.stats()["store"]["entries"] == 0  # nothing of (L, 1) kept as (L, 0)
            assert c.stats()["upstream"].get("peer_unproven", 0) >= 1
    finally:
        b.cleanup()
    assert handler.asked and handler.asked[0]["digest"] == owner.digest_hex  # it was asked
