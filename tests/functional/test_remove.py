"""`cachecd remove` and the per-model coverage in `cachecd status`, as a user runs them against
a real daemon: what is freed is checked on disk (the install dirs, the blob files), and what the
daemon keeps registered is checked across a restart."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachecd.errors import RepoNotAllowed
from tests.harness import TINY_REPO, DaemonProcess, HubProcess, run_cli, short_tmp, stop_daemon

TWIN = "cachecd/tiny-k3-twin"  # the same files under another name: every expert blob is shared


def _blobs(cache: Path) -> set[str]:
    return {f.name for f in (cache / "blobs").rglob("*") if f.is_file()}


@pytest.fixture(scope="module")
def twins(tiny_dir: Path) -> Iterator[tuple[str, dict[str, Path]]]:
    """A hub serving the tiny model under two names, and a manifest of each."""
    root = short_tmp("cdtw")
    for repo in (TINY_REPO, TWIN):
        shutil.copytree(tiny_dir, root / repo)
    hub = HubProcess(root)
    manifests = {}
    for repo in (TINY_REPO, TWIN):
        manifests[repo] = root / f"{repo.replace('/', '--')}.manifest"
        run_cli("manifest", "build", f"{repo}@main", "--endpoint", hub.url, "--output",
                str(manifests[repo]))
    yield hub.url, manifests
    hub.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_remove_frees_the_install_and_only_the_experts_no_other_model_shares(twins,
                                                                              tiny_manifest):
    url, manifests = twins
    base = short_tmp("cdrm")
    sock, cache, models = base / "run" / "s.sock", base / "cache", base / "models"
    flags = ["--endpoint", url, "--socket", str(sock), "--cache-dir", str(cache),
             "--models-dir", str(models)]
    try:
        for repo in (TINY_REPO, TWIN):
            run_cli("setup", "--stream", repo, *flags, "--manifest", str(manifests[repo]))
        installs = {repo: models / repo for repo in (TINY_REPO, TWIN)}
        assert all(any(p.rglob("*.safetensors")) for p in installs.values())
        layer = tiny_manifest.moe_layers[0]
        from cachecd_client import Client

        with Client(sock) as c:
            c.experts(TINY_REPO, layer, [0, 1, 2, 3])
            c.pin(TINY_REPO, layer, [0])
        assert len(_blobs(cache)) == 4
        status = run_cli("status", "--socket", str(sock)).stdout
        assert status.count(f"  cached    4/{tiny_manifest.n_experts} experts") == 2, status

        out = run_cli("remove", "--model", TWIN, "--experts", "--socket", str(sock)).stdout
        assert f"removed {TWIN}@" in out
        assert "0 cached experts evicted (4 kept: another registered model has the same bytes)" in out
        assert not installs[TWIN].exists() and any(installs[TINY_REPO].rglob("*.safetensors"))
        assert len(_blobs(cache)) == 4

        # The removal is durable: a restarted daemon serves the model left and refuses the other.
        stop_daemon(sock)
        d = DaemonProcess(url, cache_dir=cache, socket=sock, args=["--models-dir", str(models)])
        d.start()
        with d.client() as c:
            assert [m["repo"] for m in c.models()] == [TINY_REPO]
            with pytest.raises(RepoNotAllowed):
                c.expert(TWIN, layer, 0)

        out = run_cli("remove", "--model", TINY_REPO, "--experts", "--socket", str(sock)).stdout
        assert "4 cached experts evicted" in out and "unpinned 1 of its experts" in out
        freed = [line for line in out.splitlines() if "of resident files" in line]
        assert freed and not freed[0].startswith("freed 0 B"), out
        assert _blobs(cache) == set()
        assert not (models / "cachecd").exists()  # every install dir went, and its empty parents
        kept = next(line for line in out.splitlines() if line.startswith("kept its manifest "))
        kept_path = Path(kept.split()[3].rstrip(":"))
        assert kept_path.parent == models / "manifests" and kept_path.is_file()  # setup reuses it
        with d.client() as c:
            assert c.models() == [] and c.stats()["store"]["entries"] == 0
        d.stop()
    finally:
        try:
            stop_daemon(sock)
        except Exception:  # noqa: BLE001 - already stopped
            pass
        shutil.rmtree(base, ignore_errors=True)


def test_remove_of_a_start_registration_keeps_a_folder_it_did_not_install(daemon, tiny_manifest,
                                                                          tiny_manifest_path,
                                                                          tmp_path):
    sock = str(daemon.socket)
    own = tmp_path / "my-model"
    own.mkdir()
    (own / "config.json").write_text("{}")
    with daemon.client() as c:
        c.register(tiny_manifest_path, own)
        c.experts(TINY_REPO, tiny_manifest.moe_layers[1], [5, 6, 7])
    assert "  cached    3/" in run_cli("status", "--socket", sock).stdout
    out = run_cli("remove", "--model", TINY_REPO, "--socket", sock).stdout
    assert f"kept its resident files in {own}: it is not under the daemon's models dir" in out
    assert "left its 3 cached experts" in out and "the eviction policy frees them" in out
    assert "registers it again at its next start (serve --manifest)" in out
    assert (own / "config.json").exists() and len(_blobs(daemon.cache_dir)) == 3
    info = json.loads(run_cli("status", "--socket", sock, "--json").stdout)
    assert info["models"] == []
    again = run_cli("remove", "--model", TINY_REPO, "--socket", sock, check=False)
    assert again.returncode == 1 and "repo_not_allowed" in again.stderr
    assert f"{TINY_REPO} is not registered with this daemon" in again.stderr
