"""A down peer is skipped for a while: a stalled host (it accepts the connection and never
answers, the costly case) costs the first miss its deadline, then the misses after go straight to
the Hub without asking it, and `cachecd status` says it is skipped, for how long and why. Real
daemons on 127.0.0.1, the local hub's log counting what reached it."""

from __future__ import annotations

from tests.functional.test_sharing import FlipProxy, logged_hub, peer_daemon, range_requests
from tests.harness import TINY_REPO, expert_bytes_from_files, run_cli

__all__ = ["logged_hub"]  # a fixture, used by name

WHY = "down: no answer within its deadline (--peer-deadline)"


def test_a_stalled_peer_is_asked_once_then_skipped_while_the_hub_serves(
        logged_hub, tiny_manifest_path, tiny_manifest, tiny_dir):
    proxy = FlipProxy(1, stall=True)  # accepts, reads the request, never answers
    b = peer_daemon(logged_hub, tiny_manifest_path, proxy.url, deadline=0.5)
    layer, later = tiny_manifest.moe_layers[1], [6, 7, 8]
    try:
        mark = logged_hub.mark()
        with b.client() as c:
            views = [c.expert(TINY_REPO, layer, 5)]
            first = c.stats()
            views += [c.expert(TINY_REPO, layer, e) for e in later]  # each a miss of its own
            after = c.stats()
        status = run_cli("status", "--socket", str(b.socket)).stdout
        for e, view in zip([5, *later], views, strict=True):
            assert view.tobytes() == expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, e))
        assert proxy.connections == 1  # asked at the first miss only
        up, peer = first["upstream"], first["peers"][0]
        assert up["peer_requests"] == 1 and up["peer_faults_timeout"] == 1
        assert up["peer_skipped"] == 1 and peer["skipped_because"] == WHY
        assert 0 < peer["skipped_for_s"] <= 5 and peer["down_faults_in_a_row"] == 1
        # The later misses: no request to the peer, no fault of it, the Hub served each.
        assert after["upstream"]["peer_requests"] == 1
        assert after["upstream"]["peer_faults_timeout"] == 1
        assert after["peers"][0]["in_flight"] == 0
        assert len(range_requests(logged_hub, mark)) >= 1  # (neighbours' proven chunks kept)
        assert after["counters"]["fetched_experts"] == 1 + len(later)  # the source's
        assert f"peer        {proxy.url} SKIPPED for " in status and WHY in status, status
        assert "1 fault in a row); the Hub serves meanwhile" in status, status
    finally:
        b.cleanup()
        proxy.stop()
