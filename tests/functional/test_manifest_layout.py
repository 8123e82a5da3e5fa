"""A manifest cannot make the model wrong: its ranges are checked against the shards' own headers.

One real `cachecd hub serve` serves the tiny model and a model repo of manifests (as published
with `hf upload`). Manifests altered so that every other check passes (experts swapped in pairs
with their hashes; a shard's tensors moved one byte with their hashes and header length; one
range moved one byte) are refused by `cachecd manifest verify`, `cachecd setup --stream` and the
daemon's registration, each with one line naming the first wrong expert; a published manifest and
one built by setup still install, and `status` says where each came from. A manifest whose layout
cannot be checked gets no expert served, not even a cached one, until it is.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachecd.errors import ManifestInvalid, ManifestMismatch, ManifestUnchecked
from cachecd.manifest.manifest import Manifest
from tests import tampered
from tests.harness import (
    TINY_REPO,
    DaemonProcess,
    HubProcess,
    Installed,
    expert_bytes_from_files,
    run_cli,
    short_tmp,
)

PUBLISHED = "cachecd/manifests"
UNSHIPPED = "cachecd/tiny-unshipped"  # the tiny model under a name no manifest ships for
CASES: dict[str, tuple[Callable[[Path, Path, Path], Path], str]] = {
    "experts swapped in pairs": (lambda src, out, repo: tampered.swap_pairs(src, out),
                                 "manifest_mismatch"),
    "a shard's tensors one byte early": (tampered.shift_shard, "manifest_mismatch"),
    "one range one byte late": (tampered.shift_range, "manifest_invalid"),
}
FIRST = "layer 1 expert 0"  # the first expert of every case above is wrong


@pytest.fixture(scope="module")
def layout_hub(tiny_dir: Path) -> Iterator[tuple[HubProcess, Path]]:
    root = short_tmp("cdlay")
    shutil.copytree(tiny_dir, root / TINY_REPO)
    shutil.copytree(tiny_dir, root / UNSHIPPED)
    (root / PUBLISHED).mkdir(parents=True)
    proc = HubProcess(root)
    yield proc, root
    proc.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A huggingface_hub cache and a cachecd cache (kept headers) of the test's own."""
    return {"HF_HOME": str(tmp_path / "hf"), "XDG_CACHE_HOME": str(tmp_path / "xdg"),
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def publish(root: Path, path: Path, name: str) -> str:
    shutil.copy(path, root / PUBLISHED / name)
    return f"hf://{PUBLISHED}/{name}"


def one_line(proc: object, code: str) -> str:
    err = proc.stderr  # type: ignore[attr-defined]
    assert proc.returncode == 1 and "Traceback" not in err, err  # type: ignore[attr-defined]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cachecd: {code}: "), err
    return lines[0]


@pytest.mark.parametrize("case", list(CASES))
def test_a_tampered_manifest_is_refused_everywhere_naming_the_first_wrong_expert(
        layout_hub: tuple[HubProcess, Path], tiny_manifest_path: Path, tiny_dir: Path, tmp_path: Path,
        env: dict[str, str], case: str) -> None:
    proc_hub, root = layout_hub
    make, code = CASES[case]
    bad = make(tiny_manifest_path, tmp_path / "bad.manifest", tiny_dir)
    rev = Manifest.load(tiny_manifest_path).revision
    # verify: exit 1, the first disagreement names the first wrong expert
    proc = run_cli("manifest", "verify", str(bad), "--endpoint", proc_hub.url, env=env,
                   check=False)
    if code == "manifest_mismatch":
        assert proc.returncode == 1 and f"MISMATCH {FIRST}: " in proc.stdout, proc.stdout
        assert proc.stdout.count("MISMATCH") <= 21 and "FAILED" in proc.stdout
    else:
        assert FIRST in one_line(proc, code)
    # setup with it published: one line, nothing installed, nothing started
    url = publish(root, bad, f"{case.replace(' ', '-')}.manifest")
    models = tmp_path / "models"
    proc = run_cli("setup", "--stream", f"{TINY_REPO}@{rev}", "--endpoint", proc_hub.url,
                   "--socket", str(tmp_path / "s.sock"), "--models-dir", str(models),
                   "--manifest", url, "--no-start", env=env, check=False)
    line = one_line(proc, code)
    assert FIRST in line and ("cachecd manifest build" in line or code == "manifest_invalid")
    assert not (models / TINY_REPO).exists()
    assert not list((models / "manifests").rglob("*.header"))  # kept only after a pass
    # the daemon's registration: refused, the good model still served
    d = DaemonProcess(proc_hub.url, [tiny_manifest_path]).start()
    try:
        with d.client() as c:
            with pytest.raises(ManifestInvalid) as info:  # ManifestMismatch is one
                c.register(bad)
            assert info.value.code == code and FIRST in info.value.message
            assert "\n" not in info.value.message
            assert [m["repo"] for m in c.models()] == [TINY_REPO]
            m = Manifest.load(tiny_manifest_path)
            want = expert_bytes_from_files(tiny_dir, m.expert(1, 0))
            assert c.expert(TINY_REPO, 1, 0).tobytes() == want
    finally:
        d.cleanup()


def test_published_and_built_manifests_install_and_status_says_which(
        layout_hub: tuple[HubProcess, Path], tiny_manifest_path: Path, tiny_dir: Path,
        env: dict[str, str]) -> None:
    proc_hub, root = layout_hub
    url = publish(root, tiny_manifest_path, "tiny-k3.manifest")
    for how, repo, extra in (("published", TINY_REPO, ["--manifest", url]),
                             ("built", UNSHIPPED, ["--build-manifest"])):
        inst = Installed(short_tmp("cdlin"))
        try:
            out = run_cli("setup", "--stream", repo, "--endpoint", proc_hub.url, "--socket",
                          str(inst.socket), "--cache-dir", str(inst.base / "cache"),
                          "--models-dir", str(inst.base / "models"), *extra, env=env).stdout
            assert "every expert's byte ranges against the shards' safetensors headers" in out
            assert "installed" in out
            kept = list((inst.base / "models" / "manifests" / "headers").glob("*.header"))
            assert len(kept) == len(Manifest.load(tiny_manifest_path).shards)
            status = run_cli("status", "--socket", str(inst.socket), env=env).stdout
            if how == "published":
                assert "its hashes are its maker's word (by a full pass" in out
                assert f"manifest  {url}, made by a full pass" in status
            else:
                assert "its hashes are its maker's word" not in out
                assert "manifest  built on this machine by a full pass" in status
            assert "layout checked against the shards' headers" in status
            m = Manifest.load(tiny_manifest_path)
            with inst.client() as c:
                assert c.expert(repo, 2, 5).tobytes() == expert_bytes_from_files(
                    tiny_dir, m.expert(2, 5))
        finally:
            inst.cleanup()


def test_a_wrong_hash_is_refused_naming_the_manifest(
        layout_hub: tuple[HubProcess, Path], tiny_manifest_path: Path, tmp_path: Path,
        env: dict[str, str]) -> None:
    """Its layout is right, so it installs; the one wrong hash refuses that expert's bytes (read
    through Xet and proven against the hub's hash of the shard, so the manifest is named as
    wrong, not the hub, and not fetched again)."""
    proc_hub, _ = layout_hub
    m = Manifest.load(tiny_manifest_path)
    row = m.row(3, 7)
    bad = tampered.wrong_hash(tiny_manifest_path, tmp_path / "wrong-hash.manifest", row)
    inst = Installed(short_tmp("cdlwh"))
    try:
        run_cli("setup", "--stream", TINY_REPO, "--endpoint", proc_hub.url, "--socket",
                str(inst.socket), "--cache-dir", str(inst.base / "cache"), "--models-dir",
                str(inst.base / "models"), "--manifest", str(bad), env=env)
        with inst.client() as c:
            with pytest.raises(ManifestMismatch) as info:
                c.expert(TINY_REPO, 3, 7)
            message = info.value.message
            assert str(bad) in message and "the manifest is wrong about this expert" in message
            assert "nothing stored or served" in message and "--build-manifest" in message
            assert c.coverage(TINY_REPO)["experts_cached"] == 0
            assert c.expert(TINY_REPO, 3, 6).nbytes == m.expert(3, 6).nbytes  # the rest flows
    finally:
        inst.cleanup()


def test_no_expert_flows_before_the_layout_is_checked(
        layout_hub: tuple[HubProcess, Path], tiny_manifest_path: Path, tiny_dir: Path,
        tmp_path: Path) -> None:
    """The swapped manifest's expert (1, 0) names the blob of the real expert (1, 1): once that
    is cached, only the layout check stands between it and a wrong logit."""
    proc_hub, _ = layout_hub
    good = DaemonProcess(proc_hub.url, [tiny_manifest_path]).start()
    try:
        with good.client() as c:
            c.experts(TINY_REPO, 1, [0, 1])
    finally:
        good.stop()
    swapped = tampered.swap_pairs(tiny_manifest_path, tmp_path / "swapped.manifest")
    models = short_tmp("cdlm")
    dead = DaemonProcess("http://127.0.0.1:9", cache_dir=good.cache_dir,
                         args=["--models-dir", str(models)]).start()
    try:
        with dead.client() as c:
            c.register(swapped)  # nothing can check it: registered, unchecked
            with pytest.raises(ManifestUnchecked) as info:
                c.expert(TINY_REPO, 1, 0)
            assert info.value.retryable and "no expert of it is served" in info.value.message
            assert not c.models()[0]["layout_checked"]
    finally:
        dead.stop()
    again = DaemonProcess(proc_hub.url, cache_dir=good.cache_dir,
                          args=["--models-dir", str(models)]).start()
    try:
        with again.client() as c:
            with pytest.raises(ManifestMismatch) as mismatch:
                c.expert(TINY_REPO, 1, 0)
            assert FIRST in mismatch.value.message
            refused = c.stats()["refused_models"]  # keyed ORG/NAME@COMMIT
            assert c.models() == [] and [k.split("@")[0] for k in refused] == [TINY_REPO]
    finally:
        again.cleanup()
        dead.cleanup()
        good.cleanup()
