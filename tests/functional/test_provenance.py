"""A cached blob serves only the expert it was verified as (docs/trust.md, "A cached blob serves
only its own expert").

A manifest whose ranges and layout are honest, so the header check passes, but which gives an
expert the digest of another: once that other expert's blob is cached, the alias must not make a
hit. Each path a user takes (setup, registration, `cachecd run`, `cachecd warm`) ends in an error
naming the manifest and the expert, never in other bytes or a run that exits 0 with other tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cachecd.errors import ManifestMismatch
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

# The hub keeps the shards in Xet: each expert's bytes are proven against the Hub's own hash of
# its file, so the manifest that disagrees with them is named as what is wrong.
Refused = ManifestMismatch
PROMPT = "Experts stream from the hub into a verified cache, layer after layer."


def _setup(inst: Installed, hub: HubProcess, manifest: Path, cache: Path) -> None:
    out = run_cli("setup", "--stream", TINY_REPO, "--endpoint", hub.url, "--socket",
                  str(inst.socket), "--cache-dir", str(cache), "--models-dir",
                  str(inst.base / "models"), "--manifest", str(manifest)).stdout
    assert "installed" in out  # its layout is honest: the header check passes


def _refused(message: str, manifest: Path, layer: int, expert: int) -> None:
    assert str(manifest) in message, message
    assert f"layer={layer} expert={expert}" in message, message
    assert "nothing stored or served" in message, message


def test_an_aliased_expert_is_refused_once_its_owner_is_cached(
        hub: HubProcess, tiny_manifest_path: Path, tiny_dir: Path, tmp_path: Path) -> None:
    """Expert (1, 0) given (1, 1)'s digest: (1, 1) cached first, then (1, 0) asked for."""
    m = Manifest.load(tiny_manifest_path)
    bad = tampered.alias_digests(tiny_manifest_path, tmp_path / "alias-one.manifest",
                                 {m.row(1, 0): m.row(1, 1)})
    inst = Installed(short_tmp("cdpv"))
    try:
        _setup(inst, hub, bad, inst.base / "cache")
        with inst.client() as c:
            owner = c.expert(TINY_REPO, 1, 1).tobytes()
            assert owner == expert_bytes_from_files(tiny_dir, m.expert(1, 1))
            with pytest.raises(Refused) as info:
                c.expert(TINY_REPO, 1, 0)
            _refused(info.value.message, bad, 1, 0)
            with pytest.raises(Refused):  # and again: nothing was recorded for it
                c.experts(TINY_REPO, 1, [1, 0])
            assert c.expert(TINY_REPO, 1, 1).tobytes() == owner  # the owner still flows
            assert c.stats()["store"]["entries"] == 1  # no second copy, no wrong row
    finally:
        inst.cleanup()


def test_a_whole_aliased_layer_never_runs(
        hub: HubProcess, tiny_manifest_path: Path, tmp_path: Path) -> None:
    """Every expert of a layer given the next one's digest, the cache warmed with the real
    owners by an honest registration first: registration, `run` and `warm` all refuse."""
    m = Manifest.load(tiny_manifest_path)
    layer = m.moe_layers[0]
    every = list(range(m.experts_per_layer))
    bad = tampered.alias_layer(tiny_manifest_path, tmp_path / "alias-layer.manifest", layer)
    good = DaemonProcess(hub.url, [tiny_manifest_path]).start()
    try:
        with good.client() as c:
            for lay in m.moe_layers:  # every owner cached: an alias finds its digest
                c.experts(TINY_REPO, lay, every)
    finally:
        good.stop()
    # registration on a daemon over that cache
    d = DaemonProcess(hub.url, cache_dir=good.cache_dir).start()
    try:
        with d.client() as c:
            c.register(bad)
            with pytest.raises(Refused) as info:
                c.experts(TINY_REPO, layer, every)
            assert str(bad) in info.value.message and f"layer={layer} " in info.value.message
    finally:
        d.stop()
    # setup, then run and warm, over the same cache
    inst = Installed(short_tmp("cdpl"))
    try:
        _setup(inst, hub, bad, good.cache_dir)
        run = run_cli("run", "--model", TINY_REPO, "--socket", str(inst.socket), "--no-chat",
                      "--prompt", PROMPT, "--max-new", "4", check=False)
        assert run.returncode != 0, run.stdout  # never exit 0 with other tokens
        assert Refused.code in run.stderr and str(bad) in run.stderr, run.stderr
        prompts = tmp_path / "prompts.txt"
        prompts.write_text(PROMPT + "\n")
        warm = run_cli("warm", "--model", TINY_REPO, "--socket", str(inst.socket), "--prompts",
                       str(prompts), check=False)
        assert warm.returncode != 0, warm.stdout
        assert Refused.code in warm.stderr and str(bad) in warm.stderr, warm.stderr
    finally:
        inst.cleanup()
        d.cleanup()
        good.cleanup()
        shutil.rmtree(good.cache_dir, ignore_errors=True)


def _as_schema_1(cache_dir: Path) -> None:
    """The index as a cachecd from before provenance left it: schema 1, no sources."""
    import lmdb

    env = lmdb.open(str(cache_dir / "index.lmdb"), max_dbs=8, subdir=True)
    try:
        with env.begin(write=True) as txn:
            try:
                txn.drop(env.open_db(b"sources", txn=txn, create=False), delete=True)
            except lmdb.NotFoundError:
                pass
            txn.put(b"schema_version", b"1", db=env.open_db(b"meta", txn=txn))
    finally:
        env.close()


def test_blobs_from_before_provenance_serve_only_an_expert_no_other_claims(
        hub: HubProcess, tiny_manifest_path: Path, tiny_dir: Path, tmp_path: Path) -> None:
    """An index from before schema 2, with the aliased manifest registered: the blob whose digest
    only one expert claims is attributed to it (no download); the one two experts claim is
    verified again before it serves either, and the alias is refused."""
    m = Manifest.load(tiny_manifest_path)
    bad = tampered.alias_digests(tiny_manifest_path, tmp_path / "alias-old.manifest",
                                 {m.row(1, 0): m.row(1, 1)})
    d = DaemonProcess(hub.url)
    d.start()
    try:
        with d.client() as c:
            c.register(bad)
            c.experts(TINY_REPO, 1, [1, 2])  # honest bytes, cached before the upgrade
        d.stop()
        _as_schema_1(d.cache_dir)
        d.start()
        with d.client() as c:
            assert c.expert(TINY_REPO, 1, 2).tobytes() == expert_bytes_from_files(
                tiny_dir, m.expert(1, 2))
            assert c.stats()["counters"].get("fetched_experts", 0) == 0  # attributed, kept
            with pytest.raises(Refused) as info:
                c.expert(TINY_REPO, 1, 0)
            # named by the daemon's copy of it, which `status` lists
            _refused(info.value.message, Path(c.models()[0]["manifest"]), 1, 0)
            assert c.expert(TINY_REPO, 1, 1).tobytes() == expert_bytes_from_files(
                tiny_dir, m.expert(1, 1))
            stats = c.stats()
            assert stats["counters"]["fetched_experts"] == 1  # (1, 1) verified again
            assert stats["store"]["entries"] == 2  # and not stored twice
    finally:
        d.cleanup()


def _lying_mirror(tiny_dir: Path, commit: str, m: Manifest) -> tuple[HubProcess, Path]:
    """`cachecd hub serve` over an `hf download --local-dir` folder whose records give every
    file's real sha256 at the real commit, one shard's header with (1, 0) and (1, 1)'s tensor
    names exchanged: it vouches for the real sha256 and serves the swapped header."""
    import hashlib

    from huggingface_hub._local_folder import write_download_metadata

    root = short_tmp("cdlie")
    repo = root / TINY_REPO
    shutil.copytree(tiny_dir, repo)
    files = sorted(p for p in repo.rglob("*") if p.is_file())
    real = {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    first, second = m.expert(1, 0), m.expert(1, 1)
    tampered.swap_names_in_header(repo / first.ranges[0].file, first, second)
    for f in files:  # after the edit: huggingface_hub trusts a record not older than its file
        write_download_metadata(repo, f.relative_to(repo).as_posix(), commit, real[f])
    return HubProcess(root), root


def test_a_header_kept_from_a_lying_mirror_never_approves_a_manifest_elsewhere(
        hub: HubProcess, tiny_manifest_path: Path, tiny_dir: Path, tmp_path: Path) -> None:
    m = Manifest.load(tiny_manifest_path)
    swapped = tampered.swap_pairs(tiny_manifest_path, tmp_path / "swap-one.manifest",
                                  only=m.row(1, 0))
    mirror, root = _lying_mirror(tiny_dir, m.revision, m)
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_DISABLE_TELEMETRY": "1"}  # one keep dir for both checks
    try:
        fooled = run_cli("manifest", "verify", str(swapped), "--endpoint", mirror.url, env=env,
                         check=False)
        assert fooled.returncode == 0, fooled.stdout  # the mirror vouches for it: kept
        assert list((tmp_path / "xdg").rglob("*.header"))
        honest = run_cli("manifest", "verify", str(swapped), "--endpoint", hub.url, env=env,
                         check=False)
        assert honest.returncode == 1, honest.stdout
        assert "MISMATCH layer 1 expert 0: " in honest.stdout, honest.stdout
        offline = run_cli("manifest", "verify", str(swapped), "--endpoint", hub.url,
                          env={**env, "HF_HUB_OFFLINE": "1"}, check=False)
        assert "not checked (HF_HUB_OFFLINE)" in offline.stdout, offline.stdout
    finally:
        mirror.stop()
        shutil.rmtree(root, ignore_errors=True)
