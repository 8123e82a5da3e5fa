"""Manifest data model: round trip, expert() against the bytes on disk, every validation failure.

Checkpoints are real safetensors files written here with the safetensors library; manifests are
built from them with the real builder over a local folder (``LocalSource``).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from safetensors.numpy import save_file

from cachecd import constants, errors
from cachecd.manifest.build import SourceFile, build_manifest, quant_format_of
from cachecd.manifest.encode import name_template
from cachecd.manifest.entries import ExpertEntry
from cachecd.manifest.manifest import Manifest, parse_expert_name, read_archive, shipped_manifest
from cachecd.manifest.safetensors_header import parse_header
from cachecd.manifest.source import LocalSource

REV = "0123456789abcdef0123456789abcdef01234567"
LAYERS = (1, 3)  # checkpoint numbering, with a gap (layer 2 is dense)
EXPERTS = 4


def write_checkpoint(out: Path, *, shards: int = 3, seed: int = 0) -> Path:
    """A small MoE checkpoint: U8 expert tensors (usually one contiguous run), plus an F32
    ``w2.bias`` per expert of layer 3 that safetensors stores apart (a second range in the
    same shard); shards cut between tensors in name order so some experts span two shards."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in LAYERS:
        for e in range(EXPERTS):
            p = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}."
            for w, shape in (("w1", (6, 4)), ("w2", (4, 3)), ("w3", (6, 4))):
                tensors[p + f"{w}.weight_packed"] = rng.integers(0, 256, shape, np.uint8)
                tensors[p + f"{w}.weight_scale"] = rng.integers(0, 256, (shape[0], 1), np.uint8)
            if layer == 3:
                tensors[p + "w2.bias"] = rng.standard_normal(4).astype(np.float32)
    for layer in (1, 2, 3):
        tensors[f"language_model.model.layers.{layer}.self_attn.q_proj.weight"] = (
            rng.standard_normal((8, 8)).astype(np.float16)
        )
        tensors[f"language_model.model.layers.{layer}.mlp.gate.e_score_correction_bias"] = (
            rng.standard_normal(EXPERTS).astype(np.float32)
        )
    tensors["language_model.model.embed_tokens.weight"] = rng.standard_normal((16, 8)).astype(
        np.float16
    )
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    cuts = np.array_split(np.arange(len(names)), shards)
    weight_map = {}
    for i, idx in enumerate(cuts):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {names[j]: tensors[names[j]] for j in idx}
        save_file(part, out / fname)
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {
        "model_type": "kimi_k3",
        "text_config": {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "mxfp4-pack-quantized",
            }
        },
    }
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_text("{}")
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def manifest(ckpt: Path) -> Manifest:
    return build_manifest(LocalSource(ckpt, "cachecd/test-moe", REV), progress=False)


@pytest.fixture(scope="module")
def saved(manifest: Manifest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("m") / "x.manifest"
    manifest.save(path)
    return path


def expert_bytes(root: Path, e: ExpertEntry) -> bytes:
    out = b""
    for r in e.ranges:
        with open(root / r.file, "rb") as f:
            f.seek(r.start)
            out += f.read(r.end - r.start)
    return out


# -- the model ----------------------------------------------------------------------------------
def test_round_trip_is_equal_and_deterministic(manifest: Manifest, saved: Path) -> None:
    loaded = Manifest.load(saved)
    assert loaded == manifest
    assert loaded.to_bytes() == manifest.to_bytes() == saved.read_bytes()
    assert loaded.key == f"cachecd/test-moe@{REV}"
    assert (loaded.model_type, loaded.quant_format) == ("kimi_k3", "mxfp4-pack-quantized")
    assert loaded.moe_layers == LAYERS and loaded.experts_per_layer == EXPERTS
    assert loaded.n_experts == len(LAYERS) * EXPERTS
    assert loaded.layer_ids.dtype == np.int32 and loaded.sizes.dtype == np.int64
    assert loaded.digests.shape == (loaded.n_experts, 16) and loaded.digests.dtype == np.uint8
    assert loaded.expert(1, 2) == manifest.expert(1, 2)
    assert list(loaded.files) == sorted(loaded.files)


def test_every_expert_matches_the_bytes_on_disk(manifest: Manifest, ckpt: Path) -> None:
    headers = {}
    for shard in manifest.shards:
        data = (ckpt / shard).read_bytes()
        n, tensors = parse_header(data, len(data))
        headers.update({t.name: (shard, t) for t in tensors})
        assert manifest.files[shard].header_len == n
    seen = set()
    for row in range(manifest.n_experts):
        e = manifest.entry(row)
        blob = expert_bytes(ckpt, e)
        assert len(blob) == e.nbytes == manifest.sizes[row]
        assert xxhash.xxh3_128(blob).digest() == e.xxh3 == manifest.digests[row].tobytes()
        assert e.digest_hex == e.xxh3.hex()
        for t, off in zip(e.tensors, e.blob_offsets, strict=True):
            shard, h = headers[t.name]
            assert (t.file, t.offset, t.nbytes, t.dtype, t.shape) == (
                shard,
                h.start,
                h.nbytes,
                h.dtype,
                h.shape,
            )
            assert (
                blob[off : off + t.nbytes]
                == (ckpt / shard).read_bytes()[t.offset : t.offset + t.nbytes]
            )
            assert xxhash.xxh3_128(blob[off : off + t.nbytes]).digest() == t.xxh3
            assert parse_expert_name(t.name) == (e.layer, e.expert)
            seen.add(t.name)
    expert_names = {n for n in headers if parse_expert_name(n)}
    assert seen == expert_names
    assert {t.name for t in manifest.resident} == set(headers) - expert_names
    assert manifest.expert_bytes_total == sum(headers[n][1].nbytes for n in expert_names)


def test_split_and_non_contiguous_experts(manifest: Manifest, ckpt: Path) -> None:
    entries = manifest.experts()
    split = [e for e in entries if len({r.file for r in e.ranges}) > 1]
    gapped = [e for e in entries if len(e.ranges) > len({r.file for r in e.ranges})]
    assert split, "the fixture must split an expert across shards"
    assert gapped, "the fixture must have an expert with two ranges in one shard"
    assert manifest.split_experts == len(split)
    for e in split + gapped:
        order = [(manifest.shards.index(r.file), r.start) for r in e.ranges]
        assert order == sorted(order)
        assert e.blob_offsets[0] == 0
        assert list(e.blob_offsets[1:]) == list(np.cumsum([t.nbytes for t in e.tensors])[:-1])
        assert xxhash.xxh3_128(expert_bytes(ckpt, e)).digest() == e.xxh3


def test_row_and_missing_expert(manifest: Manifest) -> None:
    assert manifest.row(1, 0) == 0 and manifest.row(3, 3) == 2 * EXPERTS - 1
    assert manifest.expert(3, 1).layer == 3 and manifest.expert(3, 1).expert == 1
    for layer, expert in ((2, 0), (1, EXPERTS), (1, -1), (99, 0)):
        with pytest.raises(errors.ExpertNotFound):
            manifest.expert(layer, expert)


def test_non_canonical_layer_digits_keep_their_exact_name() -> None:
    assert name_template("model.layers.03.mlp.experts.7.w1.weight", 3, 7) == (
        "model.layers.03.mlp.experts.7.w1.weight",
    )
    assert name_template("a.layers.3.mlp.experts.7.w1", 3, 7) == (
        "a.layers.",
        ".mlp.experts.",
        ".w1",
    )
    with pytest.raises(errors.ManifestInvalid):
        name_template("a.layers.3.mlp.experts.7.w1", 3, 8)


def test_shipped_manifest_lookup() -> None:
    assert shipped_manifest("no-such-org/no-such-model") is None
    assert shipped_manifest("../etc/passwd") is None
    assert shipped_manifest("a/b/../c") is None
    path = shipped_manifest("cachecd/tiny-k3")
    assert path is not None and path.name == "cachecd--tiny-k3.manifest"
    assert Manifest.load(path).repo == "cachecd/tiny-k3"


# -- validation -----------------------------------------------------------------------------------
def tampered(saved: Path, edit: Any) -> bytes:
    """The saved manifest with ``edit(meta, arrays)`` applied, re-archived without validation."""
    meta, arrays = read_archive(saved.read_bytes(), "x")
    arrays = {k: v.copy() for k, v in arrays.items()}
    edit(meta, arrays)
    buf = io.BytesIO()
    raw = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez_compressed(buf, meta=raw, **arrays)
    return buf.getvalue()


def invalid(saved: Path, edit: Any) -> str:
    with pytest.raises(errors.ManifestInvalid) as info:
        Manifest.from_bytes(tampered(saved, edit), source="x.manifest")
    assert info.value.code == "manifest_invalid" and info.value.http_status == 422
    return info.value.message


def first_split_row(m: Manifest) -> int:
    return next(i for i in range(m.n_experts) if len(m.entry(i).ranges) > 1)


def test_unedited_tamper_helper_loads(saved: Path, manifest: Manifest) -> None:
    assert Manifest.from_bytes(tampered(saved, lambda m, a: None)) == manifest


def test_not_an_archive_or_bad_json(saved: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.manifest"
    bad.write_text("junk")
    with pytest.raises(errors.ManifestInvalid, match=r"bad.manifest: not a cachecd manifest"):
        Manifest.load(bad)
    bad.write_bytes(saved.read_bytes()[:200])
    with pytest.raises(
        errors.ManifestInvalid, match=r"bad.manifest: not a cachecd manifest archive"
    ):
        Manifest.load(bad)
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.frombuffer(b"{not json", np.uint8))
    with pytest.raises(errors.ManifestInvalid, match=r"^y.manifest: meta: bad JSON"):
        Manifest.from_bytes(buf.getvalue(), source="y.manifest")
    with pytest.raises(errors.ManifestInvalid, match="cannot read"):
        Manifest.load(tmp_path / "missing.manifest")


def test_unknown_format_version(saved: Path) -> None:
    msg = invalid(
        saved, lambda m, a: m.update(format_version=constants.MANIFEST_FORMAT_VERSION + 1)
    )
    assert msg.startswith("x.manifest: format_version: ") and "not supported" in msg


def test_revision_must_be_a_commit(saved: Path) -> None:
    msg = invalid(saved, lambda m, a: m.update(revision="main"))
    assert msg.startswith("x.manifest: revision: 'main' is not a 40-hex commit")


def test_wrong_digest_length(saved: Path) -> None:
    msg = invalid(saved, lambda m, a: a.update(exp_xxh3=a["exp_xxh3"][:, :8]))
    assert msg == "x.manifest: experts.xxh3: digests are 8 bytes, expected 16 (xxh3-128)"
    msg = invalid(saved, lambda m, a: a.update(t_xxh3=np.zeros((len(a["t_xxh3"]), 20), np.uint8)))
    assert msg.startswith("x.manifest: tensors.xxh3: digests are 20 bytes")

    def short_resident(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        m["resident"][2][6] = "ab" * 8

    assert invalid(saved, short_resident).startswith("x.manifest: resident[2].xxh3: ")


def test_range_past_the_end_of_its_file(saved: Path, manifest: Manifest) -> None:
    row = 5
    r0 = int(manifest._r_ptr[row])
    file = manifest.entry(row).ranges[0].file
    size = manifest.files[file].size

    def edit(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        a["r_end"][r0] = size + 10

    msg = invalid(saved, edit)
    assert (
        msg
        == f"x.manifest: experts[{row}].ranges[0] (layer {manifest.entry(row).layer} expert "
        f"{manifest.entry(row).expert}): end {size + 10} past the end of {file} (size {size})"
    )


def test_ranges_that_overlap(saved: Path, manifest: Manifest) -> None:
    # Move expert 1 (tensors and range together, so it stays self-consistent) onto expert 0.
    delta = manifest.entry(1).ranges[0].start - manifest.entry(0).ranges[0].start - 8

    def edit(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        t0, t1 = int(manifest._t_ptr[1]), int(manifest._t_ptr[2])
        r0, r1 = int(manifest._r_ptr[1]), int(manifest._r_ptr[2])
        a["t_offset"][t0:t1] -= delta
        a["r_start"][r0:r1] -= delta
        a["r_end"][r0:r1] -= delta

    msg = invalid(saved, edit)
    assert msg.startswith("x.manifest: experts[") and " overlaps experts[" in msg


def test_range_overlapping_a_resident_tensor(saved: Path, manifest: Manifest) -> None:
    e, victim = next(
        (e, t)
        for e in manifest.experts()
        for t in manifest.resident
        if t.file == e.ranges[0].file and t.nbytes <= e.ranges[0].length
    )

    def edit(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        for r in m["resident"]:
            if r[0] == victim.name:  # claim the expert's first bytes for the resident tensor
                r[4], r[5] = e.ranges[0].start, victim.nbytes

    msg = invalid(saved, edit)
    assert "overlaps" in msg and "resident[" in msg and victim.name in msg


def test_tensor_size_disagrees_with_dtype_and_shape(saved: Path, manifest: Manifest) -> None:
    t = int(manifest._t_ptr[2]) + 1
    msg = invalid(saved, lambda m, a: a["t_nbytes"].__setitem__(t, a["t_nbytes"][t] + 1))
    assert (
        msg.startswith("x.manifest: experts[2].tensors[1].nbytes (layer 1 expert 2): ")
        and "disagrees with U8" in msg
    )

    def resident(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        m["resident"][0][2] = [3, 3]

    assert "resident[0].nbytes" in invalid(saved, resident)


def test_expert_nbytes_must_equal_its_ranges(saved: Path) -> None:
    msg = invalid(saved, lambda m, a: a["exp_nbytes"].__setitem__(3, a["exp_nbytes"][3] + 1))
    assert msg.startswith("x.manifest: experts[3].nbytes (layer 1 expert 3): ")
    assert "the sum of its ranges" in msg


def test_tensors_must_tile_their_ranges(saved: Path, manifest: Manifest) -> None:
    row = first_split_row(manifest)
    t0 = int(manifest._t_ptr[row])

    def swap(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        a["t_offset"][t0], a["t_offset"][t0 + 1] = a["t_offset"][t0 + 1], a["t_offset"][t0]

    assert f"experts[{row}].tensors[0].offset" in invalid(saved, swap)


def test_structure_errors(saved: Path) -> None:
    assert "exp_nranges: column missing" in invalid(saved, lambda m, a: a.pop("exp_nranges"))
    assert "files[1].sha256" in invalid(saved, lambda m, a: m["files"][1].__setitem__(2, "zz"))
    assert "repo: " in invalid(saved, lambda m, a: m.update(repo="../../etc"))
    assert "out of order" in invalid(saved, lambda m, a: a["exp_expert"].__setitem__(0, 1))
    assert "templates[0]" in invalid(saved, lambda m, a: m["templates"][0].__setitem__(1, ".x."))
    assert "experts_per_layer" in invalid(saved, lambda m, a: m.update(experts_per_layer=3))

    def files_out_of_order(m: dict[str, Any], a: dict[str, np.ndarray]) -> None:
        m["files"][0][0] = "zzz.json"

    assert "files[1].name: 'model-00001-of-00003.safetensors' is out of name order" in invalid(
        saved, files_out_of_order
    )


def test_header_parse_errors() -> None:
    good = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
    n, ts = parse_header(len(good).to_bytes(8, "little") + good + b"xy", len(good) + 10)
    assert n == len(good) and ts[0].start == 8 + n and ts[0].nbytes == 2
    gap = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}'
    with pytest.raises(errors.ManifestInvalid, match="gap or overlap"):
        parse_header(len(gap).to_bytes(8, "little") + gap)
    with pytest.raises(errors.ManifestInvalid, match="safetensors header: bad JSON"):
        parse_header((3).to_bytes(8, "little") + b"{{{")
    with pytest.raises(errors.ManifestInvalid, match="but the file has"):
        parse_header(len(good).to_bytes(8, "little") + good, len(good) + 99)


# -- builder edge cases (real files; faults injected at the source, the network edge) ------------
class ChoppySource(LocalSource):
    """Streams in odd-sized pieces; the first stream of ``fail_file`` breaks past ``fail_at``."""

    def __init__(self, root: Path, piece: int, fail_file: str | None = None, fail_at: int = 0):
        super().__init__(root, "cachecd/test-moe", REV)
        self.piece, self.fail_file, self.fail_at, self.calls = piece, fail_file, fail_at, 0
        self.starts: list[int] = []

    def stream(self, name: str, start: int = 0):  # type: ignore[no-untyped-def]
        data = (self.root / name).read_bytes()
        if name == self.fail_file:
            self.calls += 1
            self.starts.append(start)
        for i in range(start, len(data), self.piece):
            if name == self.fail_file and self.calls == 1 and i > self.fail_at:
                raise errors.UpstreamError(f"{name}: connection reset (injected)")
            yield data[i : i + self.piece]


def test_chunking_and_a_retried_shard_give_the_same_manifest(
    manifest: Manifest, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "BACKOFF_BASE_S", 0.0)
    assert build_manifest(ChoppySource(ckpt, 37), progress=False) == manifest
    # Break the second shard in the middle of the tail of an expert whose head is in the first:
    # the retry resumes at the byte it broke at, with the hashers as they were there.
    second = manifest.shards[1]
    split = next(
        e for e in manifest.experts() if {r.file for r in e.ranges} == {manifest.shards[0], second}
    )
    tail = next(r for r in split.ranges if r.file == second)
    flaky = ChoppySource(ckpt, 7, fail_file=second, fail_at=(tail.start + tail.end) // 2)
    assert build_manifest(flaky, progress=False) == manifest
    assert flaky.calls == 2 and flaky.starts[0] == 0 and flaky.starts[1] > tail.start


def test_a_source_sha256_mismatch_writes_nothing(ckpt: Path, tmp_path: Path) -> None:
    class Lying(LocalSource):
        def list_files(self):  # type: ignore[no-untyped-def]
            return [
                SourceFile(f.name, f.size, "0" * 64 if f.name.endswith(".safetensors") else None)
                for f in super().list_files()
            ]

    # Shards are hashed in parallel: whichever lying shard finishes first is named.
    with pytest.raises(errors.ChecksumMismatch, match=r"model-0000\d-of-00003.safetensors: sha256"):
        build_manifest(Lying(ckpt, "cachecd/test-moe", REV), progress=False)


@pytest.mark.parametrize(
    ("qc", "fmt"),
    [
        (None, "none"),
        ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, "fp8"),
        # Power-of-two scales over 32x32 blocks: mlx-lm keeps them packed as mxfp8, so they must
        # not be named fp8 (which the engine dequantizes to bf16).
        ({"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}, "mxfp8"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "pack-quantized"),
    ],
)
def test_quant_format_of(qc: dict[str, Any] | None, fmt: str) -> None:
    assert quant_format_of({"quantization_config": qc} if qc else {}) == fmt
    assert quant_format_of({"text_config": {"quantization_config": qc}} if qc else {}) == fmt
