"""Bench: the layout check of a K3-sized manifest against its 96 shards' safetensors headers.

Builds the synthetic K3 manifest of ``manifest_load`` (82,432 experts, 494,592 expert tensors,
96 shards, ~1,500 resident tensors), writes for each shard the header a real checkpoint laid out
that way would have (every tensor's name, dtype, shape and offsets, padded to the manifest's
header length), and times ``layout_problems`` over them: parsing every header, and comparing
every tensor of every expert and every resident tensor. Not a test: it prints numbers; the last
line is ``check_s=X`` (median). Usage: python bench/layout_check.py [--runs N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import time

from manifest_load import synthetic_k3

from cachecd.manifest.layout_check import layout_problems
from cachecd.manifest.manifest import Manifest


def headers_of(m: Manifest) -> dict[str, bytes]:
    """Each shard's header as the manifest says it is (so the check finds nothing), padded to
    the header length the manifest gives it."""
    per: dict[str, dict[str, object]] = {s: {} for s in m.shards}

    def add(name: str, file: str, dtype: str, shape: tuple[int, ...], off: int, nb: int) -> None:
        data0 = 8 + m.files[file].header_len
        per[file][name] = {"dtype": dtype, "shape": list(shape),
                           "data_offsets": [off - data0, off + nb - data0]}

    for t in m.resident:
        add(t.name, t.file, t.dtype, t.shape, t.offset, t.nbytes)
    names, cols, _ = m.tensor_table()
    files, dtypes, shapes = m.file_names, m.dtype_names, m.shape_list
    for name, (f, off, nb, dt, sh) in zip(names, cols.tolist(), strict=True):
        add(name, files[f], dtypes[dt], shapes[sh], off, nb)
    out = {}
    for shard, tensors in per.items():
        n = m.files[shard].header_len
        body = json.dumps(tensors, separators=(",", ":")).encode()
        out[shard] = struct.pack("<Q", n) + body + b" " * (n - len(body))
    return out


def measure(m: Manifest, heads: dict[str, bytes], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        found = layout_problems(m, heads)
        times.append(time.perf_counter() - t)
        assert found == [], found[:1]
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    m = synthetic_k3()
    heads = headers_of(m)
    print(f"experts={m.n_experts} shards={len(heads)} "
          f"header_bytes={sum(map(len, heads.values()))}")
    times = measure(m, heads, args.runs)
    print(" ".join(f"{t:.2f}" for t in times))
    print(f"check_s={statistics.median(times):.2f}")


if __name__ == "__main__":
    main()
