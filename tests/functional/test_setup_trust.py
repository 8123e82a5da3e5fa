"""What an install holds is what the Hub vouches for, whoever's word a manifest is (issue 44's
attacks, each with a real `cachecd hub serve` keeping its files in Xet, real setups and a real
daemon): a new revision's manifest that calls a changed resident tensor unchanged gets the Hub's
bytes installed, not the old revision's, and says so; an install that holds such a tensor is
repaired by a later setup with no manifest; a safetensors header kept from one lying answer cannot
approve a manifest with two experts swapped, since the daemon checks layouts against headers
proven through Xet."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from cachecd.errors import ManifestMismatch
from cachecd.manifest.manifest import Manifest
from tests import tampered
from tests.harness import TINY_REPO, DaemonProcess, HubProcess, run_cli, short_tmp, stop_daemon

CHANGED = "language_model.model.norm.weight"


@dataclass
class Hub:
    root: Path
    proc: HubProcess
    main: Manifest
    v2: Manifest
    main_path: Path
    v2_path: Path


def _tensor_at(path: Path, name: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        start, end = json.loads(f.read(size))[name]["data_offsets"]
    return 8 + size + start, end - start


def _read(path: Path, name: str) -> bytes:
    offset, nbytes = _tensor_at(path, name)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def _write(path: Path, name: str, data: bytes) -> None:
    offset, _ = _tensor_at(path, name)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.fixture(scope="module")
def hub(tiny_dir: Path) -> Iterator[Hub]:
    root = short_tmp("cdtrust")
    shutil.copytree(tiny_dir, root / TINY_REPO)
    v2 = root / f"{TINY_REPO}@v2"
    shutil.copytree(tiny_dir, v2)
    norm = next(t for t in Manifest.load(_shipped()).resident if t.name == CHANGED)
    words = np.frombuffer(_read(v2 / norm.file, CHANGED), dtype="<u2").copy()
    words[:8] += 1  # one ulp up: a finite, different norm weight
    _write(v2 / norm.file, CHANGED, words.tobytes())
    proc = HubProcess(root)
    paths = {}
    for rev in ("main", "v2"):
        paths[rev] = root.parent / f"{root.name}-{rev}.manifest"
        run_cli("manifest", "build", f"{TINY_REPO}@{rev}", "--endpoint", proc.url, "--output",
                str(paths[rev]))
    yield Hub(root, proc, Manifest.load(paths["main"]), Manifest.load(paths["v2"]),
              paths["main"], paths["v2"])
    proc.stop()
    shutil.rmtree(root, ignore_errors=True)
    for p in paths.values():
        p.unlink(missing_ok=True)


def _shipped() -> Path:
    from cachecd.manifest.manifest import shipped_manifest

    path = shipped_manifest(TINY_REPO)
    assert path is not None
    return path


def _lying(hub: Hub, out: Path) -> Path:
    """v2's manifest, with the changed tensor's digest the old revision's: "unchanged"."""
    old = next(t for t in hub.main.resident if t.name == CHANGED).xxh3.hex()
    meta, arrays = tampered.read(hub.v2_path)
    for row in meta["resident"]:
        if row[0] == CHANGED:
            row[6] = old
    return tampered.write(meta, arrays, out)


def _setup(hub: Hub, base: Path, rev: str, *extra: str) -> str:
    return run_cli("setup", "--stream", f"{TINY_REPO}@{rev}", "--endpoint", hub.proc.url,
                   "--socket", str(base / "run" / "s.sock"), "--cache-dir", str(base / "cache"),
                   "--models-dir", str(base / "models"), *extra).stdout


def _installed(base: Path, manifest: Manifest) -> Path:
    return base / "models" / TINY_REPO / manifest.revision / "model-resident.safetensors"


@pytest.fixture
def base() -> Iterator[Path]:
    path = short_tmp("cdtb")
    yield path
    try:
        stop_daemon(path / "run" / "s.sock")
    except Exception:  # noqa: BLE001 - none started
        pass


def test_a_resident_tensor_called_unchanged_gets_the_hubs_bytes(hub: Hub, base: Path) -> None:
    norm = next(t for t in hub.v2.resident if t.name == CHANGED)
    want = _read(hub.root / f"{TINY_REPO}@v2" / norm.file, CHANGED)
    assert want != _read(hub.root / TINY_REPO / norm.file, CHANGED)
    _setup(hub, base, "main", "--manifest", str(hub.main_path))
    out = _setup(hub, base, "v2", "--manifest", str(_lying(hub, base / "lying.manifest")))
    assert _read(_installed(base, hub.v2), CHANGED) == want  # not the old revision's
    assert f"names other bytes than the Hub's, proven through Xet, for 1 resident tensors: " \
           f"{CHANGED}" in out


def test_a_later_setup_with_no_manifest_repairs_a_wrong_resident_tensor(hub: Hub,
                                                                        base: Path) -> None:
    norm = next(t for t in hub.v2.resident if t.name == CHANGED)
    want = _read(hub.root / f"{TINY_REPO}@v2" / norm.file, CHANGED)
    _setup(hub, base, "v2", "--manifest", str(hub.v2_path))
    installed = _installed(base, hub.v2)
    # What a manifest's word left before: the old revision's bytes for the changed tensor.
    _write(installed, CHANGED, _read(hub.root / TINY_REPO / norm.file, CHANGED))
    out = _setup(hub, base, "v2")
    assert "no manifest:" in out and "repaired 1 resident tensors" in out, out
    assert _read(installed, CHANGED) == want
    assert "fetched 0 B now" in _setup(hub, base, "v2")  # and then it holds


def test_a_kept_lying_header_cannot_approve_swapped_experts(hub: Hub, tmp_path: Path) -> None:
    from cachecd.manifest.headers import endpoint_id, keep_dir

    swapped = tampered.swap_pairs(hub.main_path, tmp_path / "swapped.manifest", only=0)
    m, bad = hub.main, Manifest.load(swapped)
    a, b = m.entry(0), m.entry(1)
    shard = a.ranges[0].file
    # The header one lying answer gave, kept: its names of experts a and b exchanged, so it
    # agrees with the swapped manifest.
    path = hub.root / TINY_REPO / shard
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        header[ta.name], header[tb.name] = header[tb.name], header[ta.name]
    body = json.dumps(header, separators=(",", ":")).encode()
    assert len(body) <= n
    d = DaemonProcess(hub.proc.url, [])
    keep = keep_dir(d.base / "models")
    keep.mkdir(parents=True)
    (keep / f"{endpoint_id(hub.proc.url)}-{m.files[shard].sha256}.header").write_bytes(
        struct.pack("<Q", n) + body + b" " * (n - len(body)))
    d.start()
    try:
        with d.client() as c:
            try:
                c.register(swapped)
            except ManifestMismatch as exc:
                assert f"layer {a.layer} expert {a.expert}" in exc.message
                return
            got = c.expert(TINY_REPO, a.layer, a.expert).tobytes()
        from tests.harness import expert_bytes_from_files

        assert got == expert_bytes_from_files(hub.root / TINY_REPO, a), \
            "the swapped manifest was approved: expert a was served expert b's bytes"
        assert bad.entry(0).digest_hex == b.digest_hex
    finally:
        d.cleanup()
