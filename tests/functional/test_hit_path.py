"""The warm-hit path of a real daemon: kept blob fds, eviction, tampering, batching on the client."""

from __future__ import annotations

import os
import time

import numpy as np

from tests.harness import TINY_REPO, DaemonProcess, expert_bytes_from_files


def _blob_fds(d: DaemonProcess) -> list[str]:
    """What the daemon's open fds point to, for files under its blobs/ (deleted ones too)."""
    assert d.proc is not None
    root, out = str(d.cache_dir / "blobs"), []
    for fd in os.listdir(f"/proc/{d.proc.pid}/fd"):
        try:
            link = os.readlink(f"/proc/{d.proc.pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith(root):
            out.append(link)
    return out


def _until(cond, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_hits_reuse_kept_fds_and_an_idle_daemon_holds_none(hub, tiny_manifest_path, tiny_manifest, tiny_dir):  # type: ignore[no-untyped-def]
    # Idle fds are closed after 4 s here (1 s by default), so a loaded machine cannot close
    # them before the look below.
    daemon = DaemonProcess(hub.url, [tiny_manifest_path],
                           env={"CACHECD_BLOB_FDS_IDLE_S": "4"}).start()
    try:
        layer, ids = tiny_manifest.moe_layers[0], [0, 1, 2, 3]
        want = [expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, e)) for e in ids]
        with daemon.client() as c:
            for _ in range(3):
                assert [a.tobytes() for a in c.experts(TINY_REPO, layer, ids)] == want
            # One kept fd per blob, not one per request (the daemon closes the dups it sent
            # just after sending, so look until they are gone).
            assert _until(lambda: len(_blob_fds(daemon)) == len(ids), 3.0), _blob_fds(daemon)
            counters = c.stats()["counters"]
            assert counters["expert_hits"] == 8 and counters["expert_misses"] == 4
        assert _until(lambda: not _blob_fds(daemon), 15.0), _blob_fds(daemon)
    finally:
        daemon.cleanup()


def test_an_evicted_blob_is_neither_served_nor_kept_open(daemon, tiny_manifest, tiny_dir):  # type: ignore[no-untyped-def]
    layer = tiny_manifest.moe_layers[1]
    want = expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, 5))
    with daemon.client() as c:
        c.experts(TINY_REPO, layer, [5, 6])
        assert c.evict(model=TINY_REPO, layer=layer, ids=[5]) > 0
        c.experts(TINY_REPO, layer, [6])  # the next request closes the evicted blob's fd
        assert not [p for p in _blob_fds(daemon) if p.endswith("(deleted)")]
        assert c.experts(TINY_REPO, layer, [5])[0].tobytes() == want
        assert c.stats()["counters"]["fetched_experts"] == 3  # 5 came from upstream again


def test_a_blob_deleted_or_truncated_on_disk_is_fetched_again(daemon, tiny_manifest, tiny_dir):  # type: ignore[no-untyped-def]
    layer = tiny_manifest.moe_layers[2]
    entries = [tiny_manifest.expert(layer, e) for e in (0, 1)]
    want = [expert_bytes_from_files(tiny_dir, e) for e in entries]
    paths = [daemon.cache_dir / "blobs" / e.digest_hex[:2] / e.digest_hex for e in entries]
    with daemon.client() as c:
        c.experts(TINY_REPO, layer, [0, 1])
        c.experts(TINY_REPO, layer, [0, 1])  # both fds kept now
        paths[0].unlink()
        os.truncate(paths[1], 10)
        assert [a.tobytes() for a in c.experts(TINY_REPO, layer, [0, 1])] == want
        assert c.stats()["counters"]["fetched_experts"] == 4


def test_out_buffers_small_and_mixed_sizes(daemon, tiny_manifest, tiny_dir):  # type: ignore[no-untyped-def]
    """Small reads run inline in the caller, big ones across the pool: both fill ``out``."""
    layer = tiny_manifest.moe_layers[0]
    ids = list(range(tiny_manifest.experts_per_layer))
    size = int(tiny_manifest.sizes.max())
    with daemon.client(readers=3) as c:
        for n in (1, len(ids)):
            out = [np.zeros(size + 7, np.uint8) for _ in range(n)]
            got = c.experts(TINY_REPO, layer, ids[:n], out=out)
            for e, a, buf in zip(ids[:n], got, out, strict=True):
                assert a.base is buf or a.base is buf.base or np.shares_memory(a, buf)
                assert a.tobytes() == expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, e))

