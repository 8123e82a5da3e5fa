"""`cachecd doctor` run as a user runs it: a cache dir on tmpfs, the table, the JSON that
`cachecd plan --doctor` reads, the local hub as the endpoint; nothing left behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cachecd.plan.disk_probe import QUEUE_DEPTHS
from tests.harness import HubProcess, run_cli

TINY_REPO = "cachecd/tiny-k3"


@pytest.fixture
def shm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not Path("/dev/shm").is_dir() or not os.access("/dev/shm", os.W_OK):
        pytest.skip("needs a writable /dev/shm (tmpfs) for a cache dir")
    base = tmp_path_factory.mktemp("doctor")  # a name only; the dir itself goes on tmpfs
    d = Path("/dev/shm") / f"cachecd-doctor-test-{base.name}"
    d.mkdir()
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def test_doctor_json_on_tmpfs_has_every_figure_and_leaves_nothing(shm_dir: Path,
                                                                  hub: HubProcess) -> None:
    out = run_cli("doctor", "--cache-dir", str(shm_dir), "--size", "64MiB", "--block", "4MiB",
                  "--network", f"{TINY_REPO}@main", "--endpoint", hub.url, "--json", timeout=120)
    report = json.loads(out.stdout)
    assert report["format"] == "cachecd-doctor" and report["version"] == 1
    (disk,) = report["disks"]
    assert disk["path"] == str(shm_dir)
    assert disk["bypassed"] is False and disk["method"].startswith("none (tmpfs")
    assert disk["block_bytes"] == 4 << 20 and disk["file_bytes"] == 64 << 20
    assert [int(q) for q in disk["cold"]] == list(QUEUE_DEPTHS)
    assert all(v > 0 for v in disk["cold"].values()) and disk["page_cache"] > 0
    mem = report["memory"]
    assert 0 < mem["available_bytes"] <= mem["total_bytes"]
    assert 0 <= mem["default_pool_bytes"] <= mem["total_bytes"] // 2
    assert report["mlx"]["backend"] in ("cpu", "metal", "cuda")
    net = report["network"]
    assert net["repo"] == TINY_REPO and len(net["revision"]) == 40
    assert net["file"].endswith(".safetensors") and net["resolve_s"] > 0
    assert net["range_bytes"] > 0 and net["range_rate"] > 0
    assert list(shm_dir.iterdir()) == []  # its temp file is gone
    assert report["elapsed_s"] < 60


def test_doctor_table_names_each_queue_depth_and_removes_a_dir_it_made(shm_dir: Path) -> None:
    fresh = shm_dir / "not-yet"
    out = run_cli("doctor", "--cache-dir", str(fresh), "--size", "16MiB", "--block", "1MiB")
    assert f"cache dir  {fresh}" in out.stdout
    assert "queue depth" in out.stdout and "32" in out.stdout and "page cache" in out.stdout
    assert "the engine's default here" in out.stdout
    assert not fresh.exists()


def test_doctor_on_a_disk_bypasses_the_page_cache(tmp_path: Path) -> None:
    if os.uname().sysname != "Linux":
        pytest.skip("checks Linux's O_DIRECT / fadvise choice")
    from cachecd.plan.disk_probe import probe_dir

    figs = probe_dir(tmp_path, 8 << 20, 1 << 20, depths=(1, 4))
    on_tmpfs = figs.method.startswith("none")
    assert figs.bypassed is not on_tmpfs
    assert on_tmpfs or figs.method in ("O_DIRECT", "posix_fadvise(DONTNEED)")
    assert list(figs.cold) == [1, 4] and list(tmp_path.iterdir()) == []


def test_doctor_times_a_running_daemons_round_trip_without_counting_a_use(
        shm_dir: Path, daemon) -> None:  # type: ignore[no-untyped-def]
    from cachecd_client import Client

    with Client(daemon.socket) as c:
        c.experts(TINY_REPO, 1, [3])  # one expert cached
        before = c.coverage(TINY_REPO)
    out = run_cli("doctor", "--cache-dir", str(shm_dir), "--size", "4MiB", "--block", "1MiB",
                  "--socket", str(daemon.socket), "--json")
    got = json.loads(out.stdout)["daemon"]
    assert got["model"] == TINY_REPO and got["expert_bytes"] == 6528
    assert 0 < got["request_s"] < 1 and got["experts"] == 1 and got["per_expert_s"] == 0
    with Client(daemon.socket) as c:
        after = c.coverage(TINY_REPO)
    assert after["accesses"] == before["accesses"]  # warming: no use counted
    none = json.loads(run_cli("doctor", "--cache-dir", str(shm_dir), "--size", "4MiB", "--block",
                              "1MiB", "--socket", str(shm_dir / "no.sock"), "--json").stdout)
    assert none["daemon"] is None
