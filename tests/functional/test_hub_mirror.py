"""`cachecd hub serve` over a folder made by `hf download --local-dir`: a LAN mirror that serves
the real revision.

The folder is made the way a user makes it: huggingface_hub's ``snapshot_download(local_dir=...)``
from a first local hub (the "Hub" here). A second hub serves it; unmodified huggingface_hub, setup
and the daemon ask it. What a download from huggingface.co leaves for a small file the Hub keeps in
git (its git blob id as the etag, not a sha256) is written into config.json's record, since the
local hub presents every file as LFS.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import HfApi, get_session, hf_hub_url, snapshot_download

from cachecd.lanhub.repo import HashCache, repo_commit, snapshot
from cachecd.manifest.manifest import Manifest
from tests.functional.test_manifest_published import TAMPERED, tamper
from tests.harness import TINY_REPO, HubProcess, Installed, LoggedHub, run_cli, short_tmp

RECORDS = Path(".cache", "huggingface", "download")


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def as_kept_in_git(repo: Path, name: str) -> str:
    """Rewrite ``name``'s download record as huggingface.co leaves it for a file in git."""
    record = repo / RECORDS / f"{name}.metadata"
    commit, _, stamp = record.read_text().splitlines()[:3]
    oid = git_oid((repo / name).read_bytes())
    record.write_text(f"{commit}\n{oid}\n{stamp}\n")
    return oid


@pytest.fixture(scope="module")
def mirror_root(hub: HubProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = short_tmp("cdmir")
    cache = tmp_path_factory.mktemp("hf")
    snapshot_download(TINY_REPO, endpoint=hub.url, local_dir=root / TINY_REPO, cache_dir=cache)
    as_kept_in_git(root / TINY_REPO, "config.json")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_the_mirror_serves_the_recorded_commit_and_sha256(
    hub: HubProcess, tiny_dir: Path, tiny_manifest: Manifest, mirror_root: Path
) -> None:
    commit = tiny_manifest.revision
    assert HfApi(endpoint=hub.url).model_info(TINY_REPO).sha == commit
    first = LoggedHub(mirror_root)
    try:
        info = HfApi(endpoint=first.url).model_info(TINY_REPO, revision=commit,
                                                     files_metadata=True)
        assert info.sha == commit
        assert HfApi(endpoint=first.url).model_info(TINY_REPO, revision="main").sha == commit
        config = (tiny_dir / "config.json").read_bytes()
        for s in info.siblings or ():
            data = (tiny_dir / s.rfilename).read_bytes()
            if not s.rfilename.endswith(".safetensors"):  # as huggingface.co lists a file in git
                assert s.lfs is None and s.blob_id == git_oid(data)
            else:
                assert s.lfs is not None and s.lfs.sha256 == hashlib.sha256(data).hexdigest()
        http = get_session()  # huggingface_hub's own HTTP client
        shard = tiny_manifest.shards[0]
        head = http.head(hf_hub_url(TINY_REPO, shard, revision=commit, endpoint=first.url),
                         follow_redirects=False)
        assert head.headers["X-Repo-Commit"] == commit
        assert head.headers["X-Linked-Etag"] == f'"{tiny_manifest.files[shard].sha256}"'
        url = hf_hub_url(TINY_REPO, "config.json", revision="main", endpoint=first.url)
        head = http.head(url, follow_redirects=True)
        assert head.headers["ETag"] == f'"{git_oid(config)}"'
        assert "X-Linked-Etag" not in head.headers
        assert http.get(url, follow_redirects=True).content == config
        hashed = [line for line in first.log() if "hashed path=" in line]
        # Only files without a sha256 in their record (kept in git) are hashed: never a shard.
        assert hashed and not any(".safetensors " in line for line in hashed), hashed
    finally:
        first.stop()
    again = LoggedHub(mirror_root)  # a restart: what was hashed is kept
    try:
        assert HfApi(endpoint=again.url).model_info(TINY_REPO).sha == commit
        assert not [line for line in again.log() if "hashed path=" in line]
    finally:
        again.stop()


def test_a_manifest_pinned_to_the_hub_works_through_the_mirror(
    tiny_manifest: Manifest, tiny_manifest_path: Path, mirror_root: Path, tmp_path: Path
) -> None:
    mirror = HubProcess(mirror_root)
    inst = Installed(short_tmp("cdmi"))
    try:
        out = run_cli("setup", "--stream", f"{TINY_REPO}@{tiny_manifest.revision}",
                      "--endpoint", mirror.url, "--socket", str(inst.socket),
                      "--cache-dir", str(inst.base / "cache"), "--models-dir",
                      str(inst.base / "models"), "--manifest", str(tiny_manifest_path),
                      env={"HF_HOME": str(tmp_path / "hf")}).stdout
        assert f"manifest checked against {mirror.url}" in out and "installed" in out
        with inst.client() as c:
            layer = tiny_manifest.moe_layers[-1]
            got = c.expert(TINY_REPO, layer, 3)
            want = tiny_manifest.expert(layer, 3)
            assert got.nbytes == want.nbytes and c.stats()["upstream"]["bytes"] > 0
        # config.json is in git here: its bytes are fetched, checked against the blob id, hashed.
        edit, says = TAMPERED["the config's hash"]
        bad = tamper(tiny_manifest_path, tmp_path / "bad.manifest", edit)
        proc = run_cli("manifest", "verify", str(bad), "--endpoint", mirror.url, check=False)
        assert proc.returncode == 1 and f"MISMATCH {says}" in proc.stdout, proc.stdout
    finally:
        inst.cleanup()
        mirror.stop()


def _records(repo: Path, commit: str) -> None:
    """Download records for every file, written by huggingface_hub's own function."""
    from huggingface_hub._local_folder import write_download_metadata

    for f in sorted(p for p in repo.rglob("*") if p.is_file() and ".cache" not in p.parts):
        name = f.relative_to(repo).as_posix()
        write_download_metadata(repo, name, commit, hashlib.sha256(f.read_bytes()).hexdigest())


def test_the_recorded_commit_only_for_exactly_that_download(
    tiny_dir: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "org" / "m"
    shutil.copytree(tiny_dir, repo)
    derived = repo_commit(repo)
    _records(repo, "ab" * 20)
    assert snapshot(repo, cache=HashCache()).commit == "ab" * 20

    extra = repo / "notes.txt"  # a file the download did not bring
    extra.write_text("mine")
    snap = snapshot(repo, cache=HashCache())
    assert not snap.recorded and snap.commit == repo_commit(repo) != derived
    extra.unlink()

    shard = repo / "model-00004-of-00012.safetensors"  # changed after its record was written
    st = shard.stat()
    os.utime(shard, (time.time() + 5, time.time() + 5))
    assert snapshot(repo, cache=HashCache()).commit == derived
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert snapshot(repo, cache=HashCache()).commit == "ab" * 20

    from huggingface_hub._local_folder import write_download_metadata

    write_download_metadata(repo, "config.json", "cd" * 20, hashlib.sha256(
        (repo / "config.json").read_bytes()).hexdigest())  # two downloads, two commits
    assert snapshot(repo, cache=HashCache()).commit == derived


def test_hashes_are_kept_across_restarts_keyed_by_size_and_mtime(tmp_path: Path) -> None:
    repo = tmp_path / "org" / "m"
    repo.mkdir(parents=True)
    f = repo / "weights.bin"
    f.write_bytes(b"a" * 1000)
    kept = tmp_path / ".cache" / "cachecd" / "sha256" / "org--m.json"
    first = snapshot(repo, cache=HashCache(), kept=kept).files["weights.bin"].sha256
    assert first == hashlib.sha256(b"a" * 1000).hexdigest() and kept.exists()
    st = f.stat()
    f.write_bytes(b"b" * 1000)  # same size, mtime put back: a restart trusts the sidecar
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert snapshot(repo, cache=HashCache(), kept=kept).files["weights.bin"].sha256 == first
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # any change of the stat: hashed again
    again = snapshot(repo, cache=HashCache(), kept=kept).files["weights.bin"].sha256
    assert again == hashlib.sha256(b"b" * 1000).hexdigest()
    kept.write_text("{not json")  # a sidecar cut short is ignored, and rewritten
    assert snapshot(repo, cache=HashCache(), kept=kept).files["weights.bin"].sha256 == again
    assert json.loads(kept.read_text())["files"]["weights.bin"][2] == again
