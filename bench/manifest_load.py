"""Bench: load + validate a K3-sized manifest, and expert() lookups.

Builds a synthetic manifest from Kimi K3's real shapes (92 MoE layers numbered 1..92, 896
experts each, six U8 tensors per expert = 17,547,264 bytes, 96 shards cut between tensors so
some experts span two shards, ~1,500 resident BF16 tensors, random digests), saves it, then
times ``Manifest.load`` (which validates everything) and ``expert()``. Not a test: it prints
numbers; the last line is ``load_s=X`` (median). Usage: python bench/manifest_load.py [--runs N]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from cachecd import constants
from cachecd.manifest.encode import build_meta
from cachecd.manifest.entries import FileInfo, TensorInfo
from cachecd.manifest.manifest import Manifest

# (suffix, rows, cols) of one K3 expert's tensors, in on-disk (name) order.
K3_TENSORS = (
    ("w1.weight_packed", 3072, 1792),
    ("w1.weight_scale", 3072, 112),
    ("w2.weight_packed", 3584, 1536),
    ("w2.weight_scale", 3584, 96),
    ("w3.weight_packed", 3072, 1792),
    ("w3.weight_scale", 3072, 112),
)
SHARDS = 96
HEADER_LEN = 900_000  # a K3 shard header is under 1 MiB
RESIDENT_PER_SHARD = 16
RESIDENT_SHAPE = (7168, 512)  # BF16


def synthetic_k3(seed: int = 0) -> Manifest:
    rng = np.random.default_rng(seed)
    layers, per_layer = constants.K3_MOE_LAYERS, constants.K3_EXPERTS_PER_LAYER
    n = layers * per_layer
    six = np.array([r * c for _, r, c in K3_TENSORS], np.int64)
    assert six.sum() == constants.K3_EXPERT_BYTES
    sizes = np.tile(six, n)
    start = np.cumsum(sizes) - sizes  # position in all experts' bytes laid end to end
    cap = -(-int(sizes.sum()) // SHARDS)
    shard = (start // cap).astype(np.int64)  # HF-style: cut between tensors
    first = np.searchsorted(shard, np.arange(SHARDS))
    res_nbytes = 2 * RESIDENT_SHAPE[0] * RESIDENT_SHAPE[1]
    data0 = 8 + HEADER_LEN + RESIDENT_PER_SHARD * res_nbytes
    offset = data0 + start - start[first][shard]
    shard_bytes = np.bincount(shard, weights=sizes, minlength=SHARDS).astype(np.int64)
    names = [f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors" for i in range(SHARDS)]
    files = [
        FileInfo(nm, data0 + int(b), _sha(nm), HEADER_LEN)
        for nm, b in zip(names, shard_bytes, strict=True)
    ]
    files += [FileInfo(nm, 4096, _sha(nm), 0) for nm in ("config.json", "tokenizer_config.json")]
    files.append(FileInfo("model.safetensors.index.json", 1 << 20, _sha("index"), 0))
    resident = [
        TensorInfo(
            f"language_model.model.layers.{s}.resident_{k}.weight",
            "BF16",
            RESIDENT_SHAPE,
            names[s],
            8 + HEADER_LEN + k * res_nbytes,
            res_nbytes,
            rng.bytes(16),
        )
        for s in range(SHARDS)
        for k in range(RESIDENT_PER_SHARD)
    ]
    meta = build_meta(
        repo="moonshotai/Kimi-K3",
        revision="ab" * 20,
        model_type="kimi_k3",
        quant_format="mxfp4-pack-quantized",
        config_sha256=_sha("config.json"),
        files=files,
        experts_per_layer=per_layer,
        resident=resident,
    )
    file_idx = {f[0]: i for i, f in enumerate(meta["files"])}
    shard_file = np.array([file_idx[nm] for nm in names], np.int32)
    meta["dtypes"] = ["U8"]
    meta["shapes"] = [[r, c] for _, r, c in K3_TENSORS]
    head = "language_model.model.layers."
    meta["templates"] = [[head, ".block_sparse_moe.experts.", "." + s] for s, _, _ in K3_TENSORS]
    row = np.repeat(np.arange(n), 6)
    boundary = np.r_[True, (row[1:] != row[:-1]) | (shard[1:] != shard[:-1])]
    r_idx = np.flatnonzero(boundary)
    r_end = np.maximum.reduceat(offset + sizes, r_idx)
    arrays = {
        "exp_layer": np.repeat(np.arange(1, layers + 1, dtype=np.int32), per_layer),
        "exp_expert": np.tile(np.arange(per_layer, dtype=np.int32), layers),
        "exp_nbytes": np.full(n, constants.K3_EXPERT_BYTES, np.int64),
        "exp_xxh3": rng.integers(0, 256, (n, 16), dtype=np.uint8),
        "exp_ntensors": np.full(n, 6, np.int32),
        "exp_nranges": np.bincount(row[r_idx], minlength=n).astype(np.int32),
        "t_template": np.tile(np.arange(6, dtype=np.int32), n),
        "t_file": shard_file[shard],
        "t_offset": offset,
        "t_nbytes": sizes,
        "t_dtype": np.zeros(6 * n, np.int32),
        "t_shape": np.tile(np.arange(6, dtype=np.int32), n),
        "t_xxh3": rng.integers(0, 256, (6 * n, 16), dtype=np.uint8),
        "r_file": shard_file[shard[r_idx]],
        "r_start": offset[r_idx],
        "r_end": r_end,
    }
    return Manifest.from_parts(meta, arrays)


def _sha(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--lookups", type=int, default=20_000)
    args = ap.parse_args()
    t0 = time.perf_counter()
    m = synthetic_k3()
    print(
        f"built experts={m.n_experts} tensors={len(m._arrays['t_file'])} "
        f"split={m.split_experts} expert_bytes={m.expert_bytes_total} "
        f"build_s={time.perf_counter() - t0:.2f}"
    )
    with tempfile.TemporaryDirectory(prefix="cdbench") as tmp:
        path = Path(tmp) / "moonshotai--Kimi-K3.manifest"
        m.save(path)
        print(f"file_bytes={path.stat().st_size}")
        times = []
        for _ in range(args.runs):
            t = time.perf_counter()
            loaded = Manifest.load(path)
            times.append(time.perf_counter() - t)
        assert loaded == m
    rng = np.random.default_rng(1)
    rows = rng.integers(0, m.n_experts, args.lookups)
    keys = [(int(m.layer_ids[r]), int(m.expert_ids[r])) for r in rows]
    t = time.perf_counter()
    for layer, expert in keys:
        loaded.expert(layer, expert)
    per_lookup = (time.perf_counter() - t) / len(keys)
    t = time.perf_counter()
    for layer, expert in keys:
        loaded.row(layer, expert)
    per_row = (time.perf_counter() - t) / len(keys)
    print(f"load_runs_s={' '.join(f'{x:.3f}' for x in times)}")
    print(f"expert_us={per_lookup * 1e6:.1f} row_us={per_row * 1e6:.2f} lookups={len(keys)}")
    print(f"load_s={statistics.median(times):.3f}")


if __name__ == "__main__":
    main()
