"""`cachecd manifest build/verify` through a real `cachecd hub serve` subprocess.

Every recorded range and hash is checked against the files on disk with code independent of the
builder (the header is parsed here with json, bytes read with plain file I/O).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import xxhash

from cachecd.lanhub.repo import repo_commit
from cachecd.manifest.build import build_manifest
from cachecd.manifest.manifest import EXPERT_RE, Manifest, shipped_manifest
from cachecd.manifest.source import HubSource, LocalSource
from tests.harness import TINY_REPO, HubProcess, run_cli, short_tmp


def read_header(path: Path) -> tuple[int, dict[str, dict]]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return n, header


def test_built_manifest_matches_the_files_on_disk(tiny_manifest: Manifest, tiny_dir: Path) -> None:
    m = tiny_manifest
    assert m.repo == TINY_REPO and m.revision == repo_commit(tiny_dir)
    on_disk = sorted(p.relative_to(tiny_dir).as_posix() for p in tiny_dir.rglob("*") if p.is_file())
    assert list(m.files) == on_disk
    for name, info in m.files.items():
        data = (tiny_dir / name).read_bytes()
        assert (info.size, info.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert m.config_sha256 == m.files["config.json"].sha256
    config = json.loads((tiny_dir / "config.json").read_text())
    assert m.model_type == config["model_type"] == "kimi_k3"
    assert m.quant_format == "mxfp4-pack-quantized"

    where: dict[str, tuple[str, int, int]] = {}
    for shard in m.shards:
        n, header = read_header(tiny_dir / shard)
        assert m.files[shard].header_len == n
        for name, spec in header.items():
            b, e = spec["data_offsets"]
            where[name] = (shard, 8 + n + b, e - b)
    weight_map = json.loads((tiny_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(where) == set(weight_map)

    seen: set[str] = set()
    for row in range(m.n_experts):
        e = m.entry(row)
        blob = b"".join(_read(tiny_dir / r.file, r.start, r.end) for r in e.ranges)
        assert len(blob) == e.nbytes and xxhash.xxh3_128(blob).digest() == e.xxh3
        for t, off in zip(e.tensors, e.blob_offsets, strict=True):
            assert (t.file, t.offset, t.nbytes) == where[t.name]
            piece = blob[off : off + t.nbytes]
            assert piece == _read(tiny_dir / t.file, t.offset, t.offset + t.nbytes)
            assert xxhash.xxh3_128(piece).digest() == t.xxh3
            seen.add(t.name)
    assert seen == {n for n in where if EXPERT_RE.search(n)}
    for t in m.resident:
        assert (t.file, t.offset, t.nbytes) == where[t.name]
        assert (
            xxhash.xxh3_128(_read(tiny_dir / t.file, t.offset, t.offset + t.nbytes)).digest()
            == t.xxh3
        )
    assert len(m.resident) + len(seen) == len(where)
    split = [r for r in range(m.n_experts) if len({x.file for x in m.entry(r).ranges}) > 1]
    assert split and m.split_experts == len(split)


def _read(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


def test_shipped_manifest_is_current(tiny_manifest: Manifest, tiny_dir: Path) -> None:
    """A generator change must come with a rebuilt manifests/cachecd--tiny-k3.manifest."""
    path = shipped_manifest(TINY_REPO)
    assert path is not None, "manifests/cachecd--tiny-k3.manifest is not shipped"
    shipped = Manifest.load(path)
    assert shipped.revision == repo_commit(tiny_dir), (
        "the tiny checkpoint changed: rebuild manifests/cachecd--tiny-k3.manifest "
        "(cachecd hub serve + cachecd manifest build cachecd/tiny-k3)"
    )
    assert shipped == tiny_manifest
    local = build_manifest(LocalSource(tiny_dir, TINY_REPO, shipped.revision), progress=False)
    assert local == shipped


def test_verify_cli(hub: HubProcess, tiny_manifest_path: Path, tmp_path: Path) -> None:
    out = run_cli("manifest", "verify", str(tiny_manifest_path), "--endpoint", hub.url).stdout
    assert "matches the endpoint" in out and "cachecd/tiny-k3" in out
    assert "split       " in out and "160 = 5 MoE layers" in out
    bad = tmp_path / "bad.manifest"
    bad.write_bytes(tiny_manifest_path.read_bytes()[:-100])
    proc = run_cli("manifest", "verify", str(bad), check=False)
    assert (
        proc.returncode == 1 and "manifest_invalid" in proc.stderr and "bad.manifest" in proc.stderr
    )


def test_unknown_revision_is_not_found(hub: HubProcess, tmp_path: Path) -> None:
    out = tmp_path / "x.manifest"
    proc = run_cli(
        "manifest", "build", f"{TINY_REPO}@v9", "--endpoint", hub.url, "-o", str(out), check=False
    )
    assert proc.returncode == 1 and "not_found" in proc.stderr and not out.exists()


@pytest.fixture
def private_hub(tiny_dir: Path):  # type: ignore[no-untyped-def]
    root = short_tmp("cdmh")
    shutil.copytree(tiny_dir, root / TINY_REPO)
    hub = HubProcess(root, token="hf_manifesttesttoken0123456789abcdef")
    yield hub, root / TINY_REPO
    hub.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_token_and_corrupted_shard(private_hub, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    hub, repo_dir = private_hub
    out = tmp_path / "m.manifest"
    build = ["manifest", "build", TINY_REPO, "--endpoint", hub.url, "-o", str(out)]
    proc = run_cli(*build, check=False)
    assert proc.returncode == 1 and not out.exists()
    assert "unauthorized" in proc.stderr or "gated" in proc.stderr  # the hub answers as HF does
    token = ["--token", "hf_manifesttesttoken0123456789abcdef"]
    run_cli(*build, *token)
    assert Manifest.load(out).revision == repo_commit(repo_dir)
    out.unlink()
    source = HubSource(TINY_REPO, "main", endpoint=hub.url, token=token[1])
    assert source.revision == repo_commit(repo_dir)
    auth = source._request_headers(f"{hub.url}/_cdn/x", {}).get("authorization", "")
    assert auth == f"Bearer {token[1]}"  # same origin as the endpoint
    for other in ("http://cdn.example/x", hub.url.replace("127.0.0.1", "localhost") + "/x"):
        assert not any(k.lower() == "authorization" for k in source._request_headers(other, {}))

    # Same size, same mtime: the hub keeps vouching for the old sha256 while serving new bytes.
    shard = repo_dir / "model-00003-of-00012.safetensors"
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(st.st_size - 5)
        byte = f.read(1)
        f.seek(st.st_size - 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    proc = run_cli(*build, *token, check=False)
    assert proc.returncode == 1, proc.stdout
    assert "checksum_mismatch" in proc.stderr and shard.name in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".m.manifest*"))
    assert "hf_manifesttesttoken" not in proc.stderr + proc.stdout
