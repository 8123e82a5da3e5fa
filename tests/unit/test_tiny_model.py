"""The tiny K3 checkpoint: deterministic bytes, K3's layout and sharding, and mlx-lm loads it.

Every check reads the written files back (safetensors headers, index.json, mlx-lm's own loaders);
nothing is taken from the generator's in-memory plan.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from cachecd.errors import InvalidRequest
from cachecd.testbed.tiny_config import TinyOptions
from cachecd.testbed.tiny_model import write_tiny_model, write_with_info

EXPERT_RE = re.compile(r"\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(\w+)$")
FP32_NAMES = ("A_log", "dt_bias", "e_score_correction_bias")
SMALL = {"experts": 8, "layers": 3}


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(data start offset, header without __metadata__) of a safetensors file."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def all_tensors(out: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (shard file name, header entry), over every shard in ``out``."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for shard in sorted(out.glob("model-*.safetensors")):
        for name, entry in read_header(shard)[1].items():
            assert name not in found, f"{name} is in two shards"
            found[name] = (shard.name, entry)
    return found


def expert_shards(out: Path) -> dict[tuple[int, int], set[str]]:
    homes: dict[tuple[int, int], set[str]] = defaultdict(set)
    for name, (shard, _) in all_tensors(out).items():
        if m := EXPERT_RE.search(name):
            homes[(int(m.group(1)), int(m.group(2)))].add(shard)
    return homes


def file_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("default") / "m")


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fp32") / "m", fmt="fp32", **SMALL)


def test_same_seed_same_bytes_other_seed_other_values(tmp_path: Path, default_model: Path) -> None:
    again = file_bytes(write_tiny_model(tmp_path / "again"))
    first = file_bytes(default_model)
    assert again == first
    other = file_bytes(write_tiny_model(tmp_path / "other", seed=1))
    assert other.keys() == first.keys()
    shards = [n for n in first if n.startswith("model-")]
    assert all(other[n] != first[n] for n in shards)
    # The seed changes values only, never the layout or the config.
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json"):
        assert other[name] == first[name]


def test_expert_names_dtypes_and_shapes(default_model: Path) -> None:
    config = json.loads((default_model / "config.json").read_text())
    text = config["text_config"]
    hidden, inter = text["routed_expert_hidden_size"], text["moe_intermediate_size"]
    want = {
        "w1": {"weight_packed": [inter, hidden // 2], "weight_scale": [inter, hidden // 32]},
        "w3": {"weight_packed": [inter, hidden // 2], "weight_scale": [inter, hidden // 32]},
        "w2": {"weight_packed": [hidden, inter // 2], "weight_scale": [hidden, inter // 32]},
    }
    seen: dict[tuple[int, int], int] = defaultdict(int)
    for name, (_, entry) in all_tensors(default_model).items():
        assert name.startswith("language_model.")
        if m := EXPERT_RE.search(name):
            assert entry["dtype"] == "U8", name
            assert entry["shape"] == want[m.group(3)][m.group(4)], name
            seen[(int(m.group(1)), int(m.group(2)))] += 1
        elif name.endswith(FP32_NAMES):
            assert entry["dtype"] == "F32", name
        else:
            assert entry["dtype"] == "BF16", name
    moe_layers = range(text["first_k_dense_replace"], text["num_hidden_layers"])
    assert set(seen) == {(layer, e) for layer in moe_layers for e in range(text["num_experts"])}
    assert set(seen.values()) == {6}


def test_config_is_k3_compressed_tensors(default_model: Path) -> None:
    config = json.loads((default_model / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    q = config["quantization_config"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "mxfp4-pack-quantized")
    weights = q["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"]) == (4, 32)
    assert "language_model.lm_head" in q["ignore"]
    assert not [m for m in q["ignore"] if ".experts." in m]
    text = config["text_config"]
    assert (
        text["linear_attn_config"]["kda_layers"] and text["linear_attn_config"]["full_attn_layers"]
    )
    generation = json.loads((default_model / "generation_config.json").read_text())
    assert config["eos_token_id"] in generation["eos_token_id"]


def test_index_matches_the_shards(default_model: Path) -> None:
    index = json.loads((default_model / "model.safetensors.index.json").read_text())
    tensors = all_tensors(default_model)
    assert index["weight_map"] == {name: shard for name, (shard, _) in tensors.items()}
    sizes = [e["data_offsets"][1] - e["data_offsets"][0] for _, e in tensors.values()]
    assert index["metadata"]["total_size"] == sum(sizes)
    shards = sorted(p.name for p in default_model.glob("model*.safetensors"))
    n = len(shards)
    assert n > 1
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    # HF order: shard i holds names that all sort before those of shard i+1.
    by_shard = [sorted(n for n, (s, _) in tensors.items() if s == shard) for shard in shards]
    assert all(a[-1] < b[0] for a, b in itertools.pairwise(by_shard))


def test_unsplit_experts_are_one_contiguous_range(default_model: Path) -> None:
    for shard in default_model.glob("model-*.safetensors"):
        _, header = read_header(shard)
        ranges: dict[tuple[int, int], list[list[int]]] = defaultdict(list)
        for name, entry in header.items():
            if m := EXPERT_RE.search(name):
                ranges[(int(m.group(1)), int(m.group(2)))].append(entry["data_offsets"])
        for expert, spans in ranges.items():
            spans.sort()
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), (shard.name, expert)


def test_default_splits_an_expert_and_small_shards_split_more(
    tmp_path: Path, default_model: Path
) -> None:
    default_split = [k for k, v in expert_shards(default_model).items() if len(v) > 1]
    assert default_split
    small = write_tiny_model(tmp_path / "small", shard_bytes=16 * 1024, **SMALL)
    homes = expert_shards(small)
    split = [k for k, v in homes.items() if len(v) > 1]
    assert len(split) >= 2
    assert all(len(v) <= 2 for v in homes.values())
    sizes = [p.stat().st_size for p in small.glob("model-*.safetensors")]
    assert len(sizes) > 10


def test_mlx_lm_loads_strict_and_generates_deterministically(default_model: Path) -> None:
    import mlx.core as mx
    from mlx_lm import generate
    from mlx_lm.utils import load_model, load_tokenizer

    model, _ = load_model(default_model, strict=True)
    tokenizer = load_tokenizer(default_model)
    logits = model(mx.array([tokenizer.encode("The quick brown fox jumps")]))
    assert mx.isfinite(logits).all().item()
    assert len(set(mx.argmax(logits[0], axis=-1).tolist())) > 3
    tokens = tokenizer.encode(generate(model, tokenizer, "Once upon a time", max_tokens=24))
    again = tokenizer.encode(generate(model, tokenizer, "Once upon a time", max_tokens=24))
    assert tokens == again
    assert len(tokens) >= 12 and len(set(tokens)) > 4


def test_tokenizer_loads_through_mlx_lm_and_round_trips(default_model: Path) -> None:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(default_model)
    for text in ("Hello, world!", "naïve café — 東京\n\ttabs", ""):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    config = json.loads((default_model / "config.json").read_text())
    assert len(tokenizer.get_vocab()) == config["text_config"]["vocab_size"]
    assert config["eos_token_id"] in tokenizer.eos_token_ids


def test_fp32_format_loads_runs_and_equals_dequantized_mxfp4(
    tmp_path: Path, fp32_model: Path
) -> None:
    import mlx.core as mx
    from mlx_lm import generate
    from mlx_lm.utils import load_model, load_tokenizer

    config = json.loads((fp32_model / "config.json").read_text())
    assert "quantization_config" not in config
    tensors = all_tensors(fp32_model)
    assert {e["dtype"] for _, e in tensors.values()} == {"F32"}
    name = "language_model.model.layers.2.block_sparse_moe.experts.5.w2"
    assert tensors[f"{name}.weight"][1]["shape"] == [64, 64]

    model, _ = load_model(fp32_model, strict=True)
    tokenizer = load_tokenizer(fp32_model)
    text = generate(model, tokenizer, "Hello", max_tokens=12)
    assert text == generate(model, tokenizer, "Hello", max_tokens=12)
    assert mx.isfinite(model(mx.array([tokenizer.encode("Hello")]))).all().item()

    # The same seed in mxfp4 holds the same expert numbers, as mlx itself dequantizes them.
    packed_dir = write_tiny_model(tmp_path / "mx", **SMALL)
    packed = _load_all(packed_dir)
    dense = _load_all(fp32_model)
    w = mx.dequantize(
        packed[f"{name}.weight_packed"].view(mx.uint32),
        packed[f"{name}.weight_scale"],
        group_size=32,
        bits=4,
        mode="mxfp4",
    )
    assert mx.array_equal(w.astype(mx.float32), dense[f"{name}.weight"]).item()


def _load_all(out: Path) -> dict[str, Any]:
    import mlx.core as mx

    weights: dict[str, Any] = {}
    for shard in out.glob("model-*.safetensors"):
        weights.update(mx.load(str(shard)))
    return weights


def test_bad_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest):
        write_tiny_model(tmp_path / "a", expert_hidden=48)
    with pytest.raises(InvalidRequest):
        write_tiny_model(tmp_path / "b", top_k=9, experts=8)
    with pytest.raises(InvalidRequest):
        write_tiny_model(tmp_path / "c", fmt="int4")


def test_rewrite_removes_stale_shards(tmp_path: Path) -> None:
    out = write_tiny_model(tmp_path / "m", shard_bytes=16 * 1024, **SMALL)
    write_tiny_model(out, shard_bytes=1 << 30, **SMALL)
    assert [p.name for p in out.glob("model*.safetensors")] == ["model-00001-of-00001.safetensors"]


def test_cli_writes_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    args = [
        "tiny-model",
        str(out),
        "--seed",
        "3",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--layers",
        "3",
        "--shard-bytes",
        "12000",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "cachecd.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "experts 16" in proc.stdout
    m = re.search(r"split experts \(across two shards\) (\d+)", proc.stdout)
    assert m and int(m.group(1)) == sum(len(v) > 1 for v in expert_shards(out).values()) > 0
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["num_experts_per_token"] == 2
    assert file_bytes(out) == file_bytes(
        write_tiny_model(tmp_path / "api", seed=3, top_k=2, shard_bytes=12000, **SMALL)
    )


def test_cli_writes_a_k2_in_fp8(tmp_path: Path) -> None:
    """--format fp8: K2-Instruct's layout (DeepSeek-V3 names, F8_E4M3 weights, block scales)."""
    from cachecd.testbed.tiny_k2 import K2Options, write_tiny_k2

    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "cachecd.cli", "tiny-model", str(out), "--format", "fp8",
         "--experts", "8", "--layers", "3", "--moe-intermediate", "192"],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "experts 16" in proc.stdout and "format fp8" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_k2"
    assert config["quantization_config"]["quant_method"] == "fp8"
    opts = K2Options(experts=8, layers=3, moe_intermediate=192, fmt="fp8")
    assert file_bytes(out) == file_bytes(write_tiny_k2(tmp_path / "api", opts).out)
    dtypes = {name: entry["dtype"] for name, (_, entry) in all_tensors(out).items()}
    expert = "model.layers.1.mlp.experts.3.up_proj"
    assert dtypes[f"{expert}.weight"] == "F8_E4M3" and dtypes[f"{expert}.weight_scale_inv"] == "F32"
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.1.mlp.gate.weight"] == "BF16"  # the router stays unquantized


def test_kimi_tokenizer_replaces_the_byte_tokenizer(tmp_path: Path) -> None:
    """--kimi-tokenizer: Kimi's form only (an earlier write's tokenizer.json would win in mlx-lm),
    and back again."""
    from cachecd.testbed import kimi_tokenizer

    out = write_tiny_model(tmp_path / "m", **SMALL)
    assert (out / "tokenizer.json").exists()
    proc = subprocess.run(
        [sys.executable, "-m", "cachecd.cli", "tiny-model", str(out), "--kimi-tokenizer",
         "--experts", "8", "--layers", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = {p.name for p in out.iterdir()}
    assert {"tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json"} <= names
    assert not names & {"tokenizer.json", "special_tokens_map.json"}
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["vocab_size"] == kimi_tokenizer.VOCAB_SIZE
    assert config["eos_token_id"] == kimi_tokenizer.token_id("<|im_end|>")
    write_tiny_model(out, **SMALL)
    assert not (out / "tiktoken.model").exists() and (out / "tokenizer.json").exists()
    with pytest.raises(InvalidRequest, match="vocab_size must be 640"):
        write_with_info(tmp_path / "x", TinyOptions(kimi_tokenizer=True), seed=0,
                        shard_bytes=1 << 20)
