"""A peer cannot hold a miss: one that trickles bytes just inside ``--peer-deadline`` is cut at
its bytes' worth of time at ``--peer-min-rate`` (plus the deadline), the Hub serves, and it is
skipped for a while as a peer that lied is; meanwhile a waiting client is told the peer is what
is slow. A peer's redirect is never followed. Real daemons on 127.0.0.1."""

from __future__ import annotations

import http.server
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.functional.test_sharing import (
    FlipProxy,
    logged_hub,
    peer_daemon,
    range_requests,
    sharer,
)
from tests.harness import TINY_REPO, expert_bytes_from_files

__all__ = ["logged_hub", "sharer"]  # fixtures, used by name


def test_a_trickling_peer_is_cut_by_its_bytes_at_the_minimum_rate_then_skipped(
        sharer, logged_hub, tiny_manifest_path, tiny_manifest, tiny_dir, caplog):
    layer, ids = tiny_manifest.moe_layers[2], [0, 1, 2, 3]
    body = sum(tiny_manifest.expert(layer, e).nbytes for e in ids)
    # 512 bytes every 0.2 s (inside the 0.5 s deadline: never a stall) is 2.5 KB/s; the peer may
    # take 0.5 s + body / 4 KiB/s, about 7 s, and would need about 10 s for the whole body.
    proxy = FlipProxy(int(sharer.share_url.rsplit(":", 1)[1]), trickle=(512, 0.2))
    b = peer_daemon(logged_hub, tiny_manifest_path, proxy.url, deadline=0.5, min_rate="4KiB")
    assert body / 2560 > 0.5 + body / 4096 + 2  # the trickle outlasts the bound by seconds
    try:
        mark = logged_hub.mark()
        with caplog.at_level(logging.WARNING, logger="cachecd_client"), b.client() as c:
            views = c.experts(TINY_REPO, layer, ids)
            stats = c.stats()
            c.experts(TINY_REPO, tiny_manifest.moe_layers[3], [5])  # skipped now: not asked
            after = c.stats()["upstream"]
        for e, view in zip(ids, views, strict=True):
            assert view.tobytes() == expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, e))
        up = stats["upstream"]
        assert up["peer_slow"] == 1 and up["peer_skipped"] == 1 and up.get("peer_experts", 0) == 0
        assert range_requests(logged_hub, mark)  # the hub served what the peer did not send
        assert after["peer_requests"] == up["peer_requests"]
        peer = stats["peers"][0]
        assert peer["skipped_for_s"] > 60 and "slower than" in peer["skipped_because"]
        waits = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
        assert waits and all(f"waiting on its peer {proxy.url}" in w for w in waits), waits
        assert not any("fetching from the Hub" in w for w in waits), waits
    finally:
        b.cleanup()
        proxy.stop()


class _Server(http.server.ThreadingHTTPServer):
    """An HTTP server on 127.0.0.1 on its own thread that counts the requests it gets."""

    def __init__(self, answer: Any) -> None:
        server = self
        self.requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                server.requests += 1
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                answer(self)

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


@pytest.fixture
def redirecting() -> Iterator[tuple[_Server, _Server]]:
    def not_found(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(404)
        h.send_header("Content-Length", "0")
        h.end_headers()

    target = _Server(not_found)

    def redirect(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(307)
        h.send_header("Location", f"{target.url}/v2/blobs")
        h.send_header("Content-Length", "0")
        h.end_headers()

    peer = _Server(redirect)
    yield peer, target
    peer.stop()
    target.stop()


def test_a_peers_redirect_is_not_followed(redirecting, logged_hub, tiny_manifest_path,
                                          tiny_manifest, tiny_dir):
    peer, target = redirecting
    b = peer_daemon(logged_hub, tiny_manifest_path, peer.url)
    try:
        layer = tiny_manifest.moe_layers[1]
        with b.client() as c:
            view = c.expert(TINY_REPO, layer, 6)
            up = c.stats()["upstream"]
        assert view.tobytes() == expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, 6))
        assert peer.requests == 1 and target.requests == 0  # asked, and its redirect not taken
        assert up["peer_faults_refused"] == 1
        assert up.get("requests_range", 0) + up.get("requests_xet_xorb", 0) >= 1  # the hub's
    finally:
        b.cleanup()
