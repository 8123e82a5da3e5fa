"""Manifests published in a Hub repo (``--manifest hf://...``) and the check every manifest
passes on use: against the Hub's own metadata for the commit it pins.

One real `cachecd hub serve` subprocess serves the tiny model and two repos holding its manifest
as one would publish it with `hf upload` (a model repo and a dataset repo); setup, the daemon and
`cachecd manifest verify` ask it with unmodified huggingface_hub. Tampered manifests (a shard's
sha256, a size, the config's hash, a commit that is not the repo's) are refused at setup, at the
daemon's registration and by verify, naming the file and the field.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachecd.errors import InvalidRequest, ManifestMismatch
from cachecd.manifest.manifest import Manifest
from cachecd.manifest.published import Published, parse
from tests.harness import TINY_REPO, DaemonProcess, HubProcess, Installed, run_cli, short_tmp

MODEL_REPO = "cachecd/manifests"  # a model repo holding manifests
DATASET_REPO = "cachecd/manifests-ds"


@pytest.fixture(scope="module")
def published(tiny_dir: Path, tiny_manifest_path: Path) -> Iterator[tuple[HubProcess, Path]]:
    root = short_tmp("cdpub")
    shutil.copytree(tiny_dir, root / TINY_REPO)
    for repo in (root / MODEL_REPO, root / "datasets" / DATASET_REPO / "k3"):
        repo.mkdir(parents=True)
        shutil.copy(tiny_manifest_path, repo / "tiny-k3.manifest")
    hub = HubProcess(root)
    yield hub, root
    hub.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A huggingface_hub cache of the test's own."""
    return {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}


def tamper(path: Path, out: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """The manifest with its meta JSON edited; still a well-formed, valid manifest."""
    with np.load(io.BytesIO(path.read_bytes()), allow_pickle=False) as npz:
        arrays = {k: npz[k].copy() for k in npz.files}
    meta = json.loads(arrays.pop("meta").tobytes())
    edit(meta)
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    out.write_bytes(buf.getvalue())
    Manifest.load(out)  # it passes every structural check: only the Hub can tell
    return out


def _file(meta: dict[str, Any], name: str) -> list[Any]:
    return next(f for f in meta["files"] if f[0] == name)


SHARD = "model-00003-of-00012.safetensors"
TAMPERED: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "a shard's sha256": (lambda m: _file(m, SHARD).__setitem__(2, "ab" * 32),
                         f"{SHARD}: sha256 {'ab' * 32} in the manifest"),
    "a file's size": (lambda m: _file(m, SHARD).__setitem__(1, _file(m, SHARD)[1] + 64),
                      f"{SHARD}: size"),
    "the config's hash": (lambda m: m.update(config_sha256="cd" * 32),
                          "config.json: config_sha256"),
    "the config file's sha256": (lambda m: _file(m, "config.json").__setitem__(2, "cd" * 32),
                                 "config.json: sha256"),
    "a file the repo lacks": (lambda m: m["files"].append(["zz-extra.json", 2, "ef" * 32, 0]),
                              "zz-extra.json: in the manifest, not in"),
    "a commit that is not the repo's": (lambda m: m.update(revision="12" * 20),
                                        f"revision: {'12' * 20} is not a commit of {TINY_REPO}"),
}


def test_a_manifest_from_hf_is_used(published: tuple[HubProcess, Path], env: dict[str, str],
                                    tiny_manifest_path: Path) -> None:
    hub, _ = published
    inst = Installed(short_tmp("cdpi"))
    try:
        out = run_cli("setup", "--stream", TINY_REPO, "--endpoint", hub.url,
                      "--socket", str(inst.socket), "--cache-dir", str(inst.base / "cache"),
                      "--models-dir", str(inst.base / "models"),
                      "--manifest", f"hf://{MODEL_REPO}/tiny-k3.manifest", env=env).stdout
        assert f"manifest hf://{MODEL_REPO}/tiny-k3.manifest (its repo at " in out
        assert f"manifest checked against {hub.url}" in out and "installed" in out
        with inst.client() as c:
            stored = c.manifest_bytes(TINY_REPO)
            assert stored == tiny_manifest_path.read_bytes()
            m = Manifest.from_bytes(stored)
            got = c.expert(TINY_REPO, m.moe_layers[0], 0)
            assert got.nbytes == m.entry(0).nbytes
    finally:
        inst.cleanup()


@pytest.mark.parametrize("url", [
    f"hf://datasets/{DATASET_REPO}/k3/tiny-k3.manifest",
    f"hf://datasets/{DATASET_REPO}/k3/tiny-k3.manifest@main",
    f"hf://datasets/{DATASET_REPO}@main/k3/tiny-k3.manifest",
])
def test_verify_reads_a_manifest_from_a_dataset_repo(
    published: tuple[HubProcess, Path], env: dict[str, str], url: str
) -> None:
    hub, _ = published
    out = run_cli("manifest", "verify", url, "--endpoint", hub.url, env=env).stdout
    assert "matches the endpoint" in out and TINY_REPO in out


def test_the_local_hub_serves_dataset_repos_to_huggingface_hub(
    published: tuple[HubProcess, Path],
) -> None:
    from huggingface_hub import HfApi

    hub, root = published
    api = HfApi(endpoint=hub.url)
    info = api.dataset_info(DATASET_REPO)
    assert info.sha and len(info.sha) == 40
    assert api.list_repo_files(DATASET_REPO, repo_type="dataset") == ["k3/tiny-k3.manifest"]
    assert not api.file_exists(DATASET_REPO, "k3/tiny-k3.manifest")  # no such model repo
    assert "tiny-k3.manifest" in api.list_repo_files(MODEL_REPO)


@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_tampered_manifest_is_refused(
    published: tuple[HubProcess, Path], tiny_manifest_path: Path, tmp_path: Path,
    env: dict[str, str], case: str
) -> None:
    hub, root = published
    edit, says = TAMPERED[case]
    bad = tamper(tiny_manifest_path, tmp_path / "bad.manifest", edit)
    rev = Manifest.load(bad).revision
    # verify: every disagreement listed, exit 1
    proc = run_cli("manifest", "verify", str(bad), "--endpoint", hub.url, env=env, check=False)
    assert proc.returncode == 1 and f"MISMATCH {says}" in proc.stdout, proc.stdout
    # setup with it published: refused before anything is installed or started
    published_bad = root / MODEL_REPO / "bad" / f"{case.replace(' ', '-')}.manifest"
    published_bad.parent.mkdir(exist_ok=True)
    shutil.copy(bad, published_bad)
    url = f"hf://{MODEL_REPO}/{published_bad.relative_to(root / MODEL_REPO).as_posix()}"
    models = tmp_path / "models"
    proc = run_cli("setup", "--stream", f"{TINY_REPO}@{rev}", "--endpoint", hub.url,
                   "--socket", str(tmp_path / "s.sock"), "--models-dir", str(models),
                   "--manifest", url, "--no-start", env=env, check=False)
    assert proc.returncode == 1 and "manifest_mismatch" in proc.stderr, proc.stderr
    assert url in proc.stderr and says in proc.stderr and "cachecd manifest build" in proc.stderr
    assert not (models / TINY_REPO).exists()


def test_the_daemon_refuses_a_tampered_manifest_at_registration(
    published: tuple[HubProcess, Path], tiny_manifest_path: Path, tmp_path: Path
) -> None:
    hub, _ = published
    d = DaemonProcess(hub.url, [tiny_manifest_path]).start()
    try:
        with d.client() as c:
            for case in ("a shard's sha256", "a commit that is not the repo's"):
                edit, says = TAMPERED[case]
                bad = tamper(tiny_manifest_path, tmp_path / "bad.manifest", edit)
                with pytest.raises(ManifestMismatch) as info:
                    c.register(bad)
                assert says in info.value.message and info.value.code == "manifest_mismatch"
            assert [m["repo"] for m in c.models()] == [TINY_REPO]  # the good one still served
            m = Manifest.load(tiny_manifest_path)
            first = m.moe_layers[0]
            assert c.expert(TINY_REPO, first, 1).nbytes == m.expert(first, 1).nbytes
    finally:
        d.cleanup()


def test_hf_urls() -> None:
    assert parse("hf://o/r/m.manifest") == Published("model", "o/r", "m.manifest", None)
    assert parse("hf://models/o/r/a/b.manifest@v1") == Published("model", "o/r", "a/b.manifest",
                                                                 "v1")
    assert parse("hf://datasets/o/r@abc/x.manifest") == Published("dataset", "o/r", "x.manifest",
                                                                  "abc")
    assert str(parse("hf://datasets/o/r@abc/x.manifest")) == "hf://datasets/o/r/x.manifest@abc"
    for bad in ("hf://o/r", "hf://o/r/", "hf://o/r@a/x@b", "hf://o/r/../x", "hf://o/../x/y"):
        with pytest.raises(InvalidRequest):
            parse(bad)
