"""The daemon as users meet it: a real `cachecd serve`, real socket, real LMDB, real HTTP upstream."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
from pathlib import Path

import pytest

from cachecd.errors import DaemonUnavailable, ExpertNotFound, InvalidRequest, RepoNotAllowed
from tests.fakes.fake_hub import FakeHubThread
from tests.harness import TINY_REPO, DaemonProcess, expert_bytes_from_files, run_cli


def _split_entries(manifest):  # type: ignore[no-untyped-def]
    return [
        manifest.entry(i) for i in range(manifest.n_experts) if len(manifest.entry(i).ranges) > 1
    ]


def test_miss_fetch_verify_then_hit_without_the_hub(
    daemon, tiny_manifest, tiny_dir, hub_root, tiny_manifest_path
):
    layer = tiny_manifest.moe_layers[0]
    ids = [0, 3, 7]
    with daemon.client() as c:
        first = c.experts(TINY_REPO, layer, ids)
        for e, got in zip(ids, first, strict=True):
            assert got.tobytes() == expert_bytes_from_files(
                tiny_dir, tiny_manifest.expert(layer, e)
            )
        stats = c.stats()["counters"]
        assert stats["expert_misses"] == 3 and stats["fetched_experts"] == 3
    # Hits never reach the hub: serve the same experts from a daemon whose endpoint is dead.
    daemon.stop()
    offline = DaemonProcess(
        "http://127.0.0.1:9", [tiny_manifest_path], cache_dir=daemon.cache_dir, socket=daemon.socket
    ).start()
    try:
        with offline.client() as c:
            again = c.experts(TINY_REPO, layer, ids)
            assert [a.tobytes() for a in again] == [f.tobytes() for f in first]
            assert c.stats()["counters"]["expert_hits"] == 3
    finally:
        offline.stop()


def test_split_experts_are_served_whole(daemon, tiny_manifest, tiny_dir):
    split = _split_entries(tiny_manifest)
    assert split, "the tiny checkpoint must have experts split across shards"
    with daemon.client() as c:
        for entry in split:
            got = c.expert(TINY_REPO, entry.layer, entry.expert)
            assert got.tobytes() == expert_bytes_from_files(tiny_dir, entry)


def test_restart_keeps_the_cache(daemon, tiny_manifest):
    layer = tiny_manifest.moe_layers[-1]
    with daemon.client() as c:
        c.experts(TINY_REPO, layer, [1, 2])
    assert daemon.stop() == 0
    assert not daemon.socket.exists()
    daemon.start()
    with daemon.client() as c:
        c.experts(TINY_REPO, layer, [1, 2])
        counters = c.stats()["counters"]
    assert counters["expert_hits"] == 2 and counters.get("expert_misses", 0) == 0


def test_http_api_with_curl(daemon, tiny_manifest, tiny_dir):
    layer = tiny_manifest.moe_layers[1]
    base = ["curl", "-s", "--unix-socket", str(daemon.socket)]
    out = subprocess.run(
        [*base, f"http://d/v1/models/{TINY_REPO}/experts/{layer}/4"],
        capture_output=True,
        check=True,
    ).stdout
    assert out == expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, 4))
    health = json.loads(subprocess.run([*base, "http://d/healthz"], capture_output=True).stdout)
    assert health["ok"] is True
    err = json.loads(
        subprocess.run(
            [*base, f"http://d/v1/models/{TINY_REPO}/experts/{layer}/999"], capture_output=True
        ).stdout
    )
    assert err["error"] == "expert_not_found" and err["retryable"] is False
    metrics = subprocess.run([*base, "http://d/metrics"], capture_output=True, text=True).stdout
    assert "\ncachecd_fetched_experts_total 1.0\n" in metrics


def test_typed_errors_reach_the_client(daemon, tiny_manifest):
    with daemon.client() as c:
        with pytest.raises(RepoNotAllowed, match="setup --stream"):
            c.expert("nobody/nothing", 1, 0)
        with pytest.raises(ExpertNotFound):
            c.expert(TINY_REPO, tiny_manifest.moe_layers[0], 10_000)
        with pytest.raises(InvalidRequest):
            c.expert("../etc", 1, 0)


def test_client_without_daemon_names_the_fix(tmp_path):
    from cachecd_client import Client

    with pytest.raises(DaemonUnavailable, match="cachecd serve"):
        Client(Path("/tmp/no-such-cachecd.sock")).health()


def test_a_miss_is_answered_once_verified_before_its_blob_is_durable(
    hub, tiny_manifest, tiny_dir, tiny_manifest_path
):
    # The write path is held before its fsync; the verified bytes must not wait for it. A later
    # request waits for the commit (it is counted a hit), and status shows the committed blob.
    d = DaemonProcess(hub.url, [tiny_manifest_path],
                      env={"CACHECD_PAUSE_AT": "after_tmp_write:4"}).start()
    try:
        layer = tiny_manifest.moe_layers[1]
        want = expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, 4))
        digest = tiny_manifest.expert(layer, 4).digest_hex
        blob = d.cache_dir / "blobs" / digest[:2] / digest
        with d.client() as c:
            assert c.expert(TINY_REPO, layer, 4).tobytes() == want
            assert not blob.exists(), "answered only after the blob was renamed into place"
            assert list((d.cache_dir / "tmp").iterdir()), "the temp file is still being committed"
            assert c.expert(TINY_REPO, layer, 4).tobytes() == want
            stats = c.stats()
            assert stats["store"]["entries"] == 1 and blob.exists()
            # The policy counts the use that caused the fetch once the blob is in, as for any use.
            assert (stats["store"]["uses_cached"], stats["store"]["uses_gone"]) == (2, 0)
            assert stats["counters"]["expert_misses"] == 1
            assert stats["counters"]["expert_hits"] == 1
            assert stats["counters"]["fetched_experts"] == 1
    finally:
        d.cleanup()


def test_64_concurrent_requests_one_upstream_get(tiny_manifest, tiny_dir, tiny_manifest_path):
    with FakeHubThread(tiny_dir, repo=TINY_REPO, revision=tiny_manifest.revision) as fake:
        fake.faults.delay = 0.5
        d = DaemonProcess(fake.url, [tiny_manifest_path]).start()
        fake.clear_records()  # the registration read the shards' headers (the layout check)
        try:
            layer = tiny_manifest.moe_layers[2]
            with d.client(readers=2) as c, concurrent.futures.ThreadPoolExecutor(64) as pool:
                got = list(pool.map(lambda _: c.expert(TINY_REPO, layer, 9).tobytes(), range(64)))
            assert len(set(got)) == 1
            assert got[0] == expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, 9))
            assert fake.count("cdn_get") == 1
        finally:
            d.cleanup()


def test_wrong_upstream_bytes_are_never_served(tiny_manifest, tiny_dir, tiny_manifest_path):
    from cachecd.errors import ChecksumMismatch

    with FakeHubThread(tiny_dir, repo=TINY_REPO, revision=tiny_manifest.revision) as fake:
        fake.faults.flip_byte = True
        d = DaemonProcess(fake.url, [tiny_manifest_path]).start()
        try:
            layer = tiny_manifest.moe_layers[0]
            with d.client() as c:
                with pytest.raises(ChecksumMismatch):
                    c.expert(TINY_REPO, layer, 5)
                assert c.stats()["store"]["entries"] == 0
                fake.faults.flip_byte = False
                good = c.expert(TINY_REPO, layer, 5)
            assert good.tobytes() == expert_bytes_from_files(
                tiny_dir, tiny_manifest.expert(layer, 5)
            )
        finally:
            d.cleanup()


def test_budget_holds(hub, tiny_manifest, tiny_manifest_path):
    expert = int(tiny_manifest.sizes.max())
    budget = expert * 10
    d = DaemonProcess(hub.url, [tiny_manifest_path], args=["--budget", str(budget)]).start()
    try:
        with d.client() as c:
            for layer in tiny_manifest.moe_layers:
                c.experts(TINY_REPO, layer, list(range(8)))
                c.stats()  # answers once the commits are done: every blob is in place
                on_disk = sum(
                    f.stat().st_size for f in (d.cache_dir / "blobs").rglob("*") if f.is_file()
                )
                assert on_disk <= budget
            stats = c.stats()["store"]
        assert stats["bytes"] <= budget
    finally:
        d.cleanup()


def test_second_daemon_on_the_same_cache_exits(daemon, tiny_manifest_path):
    other = DaemonProcess(daemon.endpoint, [tiny_manifest_path], cache_dir=daemon.cache_dir)
    try:
        with pytest.raises(AssertionError, match="exited"):
            other.start(timeout=30)
        assert "cache_locked" in other.log() or "lock" in other.log().lower()
    finally:
        other.cleanup()


def test_other_uid_is_refused(daemon, as_nobody):
    nobody = as_nobody("-c", "import cachecd_client, cachecd.errors")
    # Widen the modes on purpose: the uid check must hold even when the file modes do not.
    os.chmod(daemon.base, 0o755)  # mkdtemp makes it 0700
    os.chmod(daemon.socket.parent, 0o777)
    os.chmod(daemon.socket, 0o666)
    os.chmod(daemon.socket.with_name(daemon.socket.name + ".data"), 0o666)
    code = (
        "import sys; from cachecd_client import Client; from cachecd.errors import Forbidden\n"
        f"c = Client({str(daemon.socket)!r})\n"
        "try:\n    c.health()\nexcept Forbidden:\n    sys.exit(3)\n"
        "sys.exit(0)\n"
    )
    proc = subprocess.run(
        nobody.argv("-c", code), capture_output=True, text=True, cwd="/", env=nobody.env(HOME="/tmp")
    )
    assert proc.returncode == 3, proc.stderr
    assert "peer refused uid=65534" in daemon.log()


def test_status_command(daemon, tiny_manifest):
    with daemon.client() as c:
        c.expert(TINY_REPO, tiny_manifest.moe_layers[0], 1)
    out = run_cli("status", "--socket", str(daemon.socket)).stdout
    assert "hit rate" in out and TINY_REPO in out
    data = json.loads(run_cli("status", "--socket", str(daemon.socket), "--json").stdout)
    assert data["store"]["entries"] == 1


def test_sigterm_drains_and_exits_zero(daemon, tiny_manifest):
    with daemon.client() as c:
        c.expert(TINY_REPO, tiny_manifest.moe_layers[0], 2)
    assert daemon.stop() == 0
    assert not daemon.socket.exists()
    assert not list((daemon.cache_dir / "tmp").iterdir())


def test_socket_modes(daemon):
    assert oct(daemon.socket.parent.stat().st_mode & 0o777) == oct(0o700)
    assert oct(daemon.socket.stat().st_mode & 0o777) == oct(0o600)


def test_fsck_finds_bit_rot_and_repair_leads_to_a_refetch(daemon, tiny_manifest, tiny_dir):
    layer = tiny_manifest.moe_layers[0]
    with daemon.client() as c:
        c.experts(TINY_REPO, layer, [0, 1])
    assert daemon.stop() == 0
    assert run_cli("fsck", "--cache-dir", str(daemon.cache_dir)).returncode == 0
    victim = tiny_manifest.expert(layer, 1).digest_hex
    blob = next((daemon.cache_dir / "blobs").rglob(victim))
    with open(blob, "r+b") as f:  # flip one byte in place, as bit rot would
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad = run_cli("fsck", "--cache-dir", str(daemon.cache_dir), check=False)
    assert bad.returncode == 1 and victim in bad.stdout
    assert run_cli("fsck", "--cache-dir", str(daemon.cache_dir), "--repair", check=False).returncode == 1
    assert run_cli("fsck", "--cache-dir", str(daemon.cache_dir)).returncode == 0
    daemon.start()
    with daemon.client() as c:
        got = c.expert(TINY_REPO, layer, 1)
        assert c.stats()["counters"]["expert_misses"] == 1
    assert got.tobytes() == expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, 1))
