"""A second source of expert bytes through a real daemon: ``file://FOLDER`` picks the local-folder
source (``cachecd.upstream.local_folder``, one module plus one line in ``choose.KINDS``), and the
same verify-then-commit path and checks on use serve its bytes."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.harness import TINY_REPO, DaemonProcess, expert_bytes_from_files, short_tmp


def test_a_daemon_serves_experts_read_from_a_local_folder(tiny_manifest_path, tiny_manifest,
                                                          tiny_dir, hub_root):
    daemon = DaemonProcess(f"file://{hub_root}", [tiny_manifest_path]).start()
    try:
        layer = tiny_manifest.moe_layers[0]
        split = [tiny_manifest.entry(i) for i in range(tiny_manifest.n_experts)
                 if len(tiny_manifest.entry(i).ranges) > 1][:1]
        with daemon.client() as c:
            got = c.experts(TINY_REPO, layer, [0, 5])
            for e, view in zip([0, 5], got, strict=True):
                want = expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, e))
                assert view.tobytes() == want
            for entry in split:  # an expert in two shards comes back whole
                assert (c.expert(TINY_REPO, entry.layer, entry.expert).tobytes()
                        == expert_bytes_from_files(tiny_dir, entry))
            stats = c.stats()
        assert stats["counters"]["fetched_experts"] == 2 + len(split)
        assert stats["upstream"]["requests_range"] >= 2 and stats["upstream"]["bytes"] > 0
        assert [m["repo"] for m in stats["models"]] == [TINY_REPO]
    finally:
        daemon.cleanup()


def test_a_folder_whose_shard_differs_is_refused_by_the_check_on_use(tiny_manifest_path,
                                                                     tiny_manifest, tiny_dir):
    root = short_tmp("cdlocal")
    shutil.copytree(tiny_dir, root / TINY_REPO)
    shard = Path(root / TINY_REPO / tiny_manifest.shards[0])
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only the sha256 tells
    shard.write_bytes(bytes(data))
    daemon = DaemonProcess(f"file://{root}", [tiny_manifest_path]).start()
    try:
        with daemon.client() as c:
            stats = c.stats()
        assert stats["models"] == []
        (reason,) = stats["refused_models"].values()
        assert "sha256" in reason and tiny_manifest.shards[0] in reason
    finally:
        daemon.cleanup()
        shutil.rmtree(root, ignore_errors=True)
