"""The layout check (``manifest.layout_check``) against real safetensors headers of the tiny K3.

The tiny checkpoint is written to disk, its manifest built from it, and its shards' headers read
from the files; each altered manifest passes every structural check, so only the headers can
tell, and the first problem must name the first wrong expert (or tensor).
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from cachecd import errors
from cachecd.manifest.build import build_manifest
from cachecd.manifest.build_plan import read_header
from cachecd.manifest.entries import FileInfo
from cachecd.manifest.headers import endpoint_id, kept
from cachecd.manifest.layout_check import check_layout, layout_problems
from cachecd.manifest.manifest import Manifest
from cachecd.manifest.safetensors_header import parse_header, parse_header_columns
from cachecd.manifest.source import LocalSource
from tests import tampered

REPO, REV = "cachecd/tiny-k3", "ab" * 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, bytes]]:
    from cachecd.testbed.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("lay")
    write_tiny_model(root / "m")
    source = LocalSource(root / "m", REPO, REV)
    manifest = build_manifest(source, progress=False)
    manifest.save(root / "good.manifest")
    files = {f.name: f for f in source.list_files()}
    headers = {s: read_header(source, files[s]) for s in manifest.shards}
    return root / "m", root / "good.manifest", headers


def test_a_built_manifest_agrees_with_its_headers(tiny: tuple[Path, Path, dict[str, bytes]]) -> None:
    _, good, headers = tiny
    manifest = Manifest.load(good)
    assert layout_problems(manifest, headers) == []
    check_layout(manifest, headers)


def test_swapped_experts_are_named_in_row_order(tiny: tuple[Path, Path, dict[str, bytes]],
                                               tmp_path: Path) -> None:
    _, good, headers = tiny
    bad = Manifest.load(tampered.swap_pairs(good, tmp_path / "bad.manifest"))
    found = layout_problems(bad, headers)
    assert found[0].startswith("layer 1 expert 0: its tensor language_model.model.layers.1."
                               "block_sparse_moe.experts.0.w1.weight_packed is ")
    assert found[1].startswith("layer 1 expert 1: ")
    assert len(found) == sum(1 for e in bad.experts()
                             if e.ranges != Manifest.load(good).expert(e.layer, e.expert).ranges)
    with pytest.raises(errors.ManifestMismatch, match=r"bad.manifest: layer 1 expert 0: .* \(and "
                       rf"{len(found) - 1} more\)\. Its byte ranges are not"):
        check_layout(bad, headers)


def test_a_shifted_shard_names_its_experts_then_its_header_length(
        tiny: tuple[Path, Path, dict[str, bytes]], tmp_path: Path) -> None:
    repo_dir, good, headers = tiny
    bad = Manifest.load(tampered.shift_shard(good, tmp_path / "bad.manifest", repo_dir))
    found = layout_problems(bad, headers)
    shard = bad.entry(0).ranges[0].file
    first = Manifest.load(good).expert(1, 0).tensors[0]
    assert found[0].startswith("layer 1 expert 0: ")
    assert (f"bytes {first.offset - 1}..{first.offset + first.nbytes - 1} (U8 "
            f"{list(first.shape)}) in the manifest, {shard} bytes {first.offset}..") in found[0]
    assert any(p.startswith("resident tensor ") for p in found)
    assert found[-1].startswith(f"{shard}: its safetensors header is ")


def test_a_header_tensor_the_manifest_lacks_is_named(tiny: tuple[Path, Path, dict[str, bytes]],
                                                    tmp_path: Path) -> None:
    _, good, headers = tiny
    meta, arrays = tampered.read(good)
    dropped = meta["resident"].pop(0)[0]
    bad = Manifest.load(tampered.write(meta, arrays, tmp_path / "bad.manifest"))
    assert layout_problems(bad, headers) == [
        f"{Manifest.load(good).resident[0].file}: its header names {dropped} (a resident "
        "tensor), which the manifest lacks"]


def test_swapped_resident_tensors_are_named(tiny: tuple[Path, Path, dict[str, bytes]],
                                           tmp_path: Path) -> None:
    _, good, headers = tiny
    meta, arrays = tampered.read(good)
    res = meta["resident"]
    i, j = next((i, j) for i in range(len(res)) for j in range(i + 1, len(res))
                if res[i][1:3] == res[j][1:3] and res[i][3] == res[j][3])
    for k in (4, 6):  # offset and hash move together
        res[i][k], res[j][k] = res[j][k], res[i][k]
    bad = Manifest.load(tampered.write(meta, arrays, tmp_path / "bad.manifest"))
    found = layout_problems(bad, headers)
    assert len(found) == 2 and all(p.startswith("resident tensor ") for p in found)


def test_headers_are_checked_against_their_shards_size(
        tiny: tuple[Path, Path, dict[str, bytes]]) -> None:
    _, good, headers = tiny
    manifest = Manifest.load(good)
    shard = manifest.shards[0]
    size = manifest.files[shard].size
    n, cols = parse_header_columns(headers[shard], size, shard)
    n2, objs = parse_header(headers[shard], size, shard)
    assert n == n2 and cols.names == [t.name for t in objs]
    assert cols.starts.tolist() == [t.start for t in objs]
    with pytest.raises(errors.ManifestInvalid, match="but the file has"):
        parse_header_columns(headers[shard], size + 1, shard)
    raw = headers[shard]
    body = raw[8:].replace(b'"data_offsets":[0,', b'"data_offsets":[1,', 1)
    with pytest.raises(errors.ManifestInvalid, match="gap or overlap"):
        parse_header_columns(struct.pack("<Q", len(body)) + body, size, shard)


def test_a_kept_header_is_used_only_while_it_checks(
        tiny: tuple[Path, Path, dict[str, bytes]], tmp_path: Path) -> None:
    _, good, headers = tiny
    manifest = Manifest.load(good)
    f = manifest.files[manifest.shards[0]]
    hub, mirror = "http://hub.example", "http://mirror.example"
    assert kept(tmp_path, f, hub) is None
    path = tmp_path / f"{endpoint_id(hub)}-{f.sha256}.header"
    path.write_bytes(headers[f.name])
    assert kept(tmp_path, f, hub) == headers[f.name]
    assert kept(tmp_path, f, hub + "/") == headers[f.name]
    assert kept(tmp_path, f, mirror) is None  # another endpoint's word is not this one's
    other = FileInfo(f.name, f.size + 8, f.sha256, f.header_len)  # a size it does not describe
    assert kept(tmp_path, other, hub) is None
    path.write_bytes(headers[f.name][:-3])
    assert kept(tmp_path, f, hub) is None


def test_headers_that_change_between_reads_are_the_endpoints_fault(
        tiny: tuple[Path, Path, dict[str, bytes]], tmp_path: Path) -> None:
    """A first read of a shard's header (its first Range GET) comes from a copy whose header
    names one tensor otherwise: the manifest is not blamed, since a second read differs, and the
    next check reads clean headers and passes. An endpoint that says the other thing every time
    refutes the manifest."""
    import shutil

    from cachecd.manifest import hub_check
    from tests.fakes.fake_hub import FakeHubThread, Faults

    repo_dir, good, headers = tiny
    manifest = Manifest.load(good)
    shard = manifest.shards[0]
    other = tmp_path / "other"
    shutil.copytree(repo_dir, other)
    raw = (other / shard).read_bytes()
    name = parse_header(headers[shard], manifest.files[shard].size, shard)[1][0].name.encode()
    (other / shard).write_bytes(raw.replace(name, name[:-1] + b"X", 1))
    hub_check._agreed.clear()
    with FakeHubThread(repo_dir, repo=REPO, revision=REV) as hub:
        hub.faults = Faults(serve_from=other, times=1)
        with pytest.raises(errors.BadUpstreamRange, match="two different safetensors headers"):
            hub_check.check_layout_at(manifest, endpoint=hub.url, parallel=1)
        hub_check.check_layout_at(manifest, endpoint=hub.url, parallel=1)
        hub.faults = Faults(serve_from=other)  # every read: the endpoint says the other thing
        hub_check._agreed.clear()
        with pytest.raises(errors.ManifestMismatch, match="in no shard's header"):
            hub_check.check_layout_at(manifest, endpoint=hub.url, parallel=1)
    hub_check._agreed.clear()
