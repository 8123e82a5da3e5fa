"""Manifests altered as an attacker (or a buggy publisher) would: every structural check passes, the
files, sizes, sha256s and config hash still agree with the Hub, and the hashes agree with the
bytes the altered ranges point at, so only the shards' own headers can tell.

Each helper reads a good manifest file and writes the altered one (``Manifest.load`` is asked of
the result, except where the alteration is one a structural check catches).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from cachecd.manifest.manifest import Manifest

Arrays = dict[str, np.ndarray]


def read(path: Path) -> tuple[dict[str, Any], Arrays]:
    with np.load(io.BytesIO(path.read_bytes()), allow_pickle=False) as npz:
        arrays = {k: npz[k].copy() for k in npz.files}
    return json.loads(arrays.pop("meta").tobytes()), arrays


def write(meta: dict[str, Any], arrays: Arrays, out: Path, *, check: bool = True) -> Path:
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    out.write_bytes(buf.getvalue())
    if check:
        Manifest.load(out)  # it passes every structural check
    return out


def _ptrs(a: Arrays) -> tuple[np.ndarray, np.ndarray]:
    t = np.concatenate([[0], np.cumsum(a["exp_ntensors"])]).astype(np.int64)
    r = np.concatenate([[0], np.cumsum(a["exp_nranges"])]).astype(np.int64)
    return t, r


def swap_pairs(src: Path, out: Path, only: int | None = None) -> Path:
    """Experts swapped in pairs (0 and 1, 2 and 3, ... of each layer, where both lie in one range
    of the same shard): their byte ranges, tensor offsets and xxh3 hashes exchanged together,
    the meta untouched. ``only``: the one pair of rows ``only`` and ``only + 1``."""
    meta, a = read(src)
    tp, rp = _ptrs(a)
    one = np.flatnonzero(a["exp_nranges"] == 1)
    pairs = [(i, i + 1) for i in one if i + 1 in set(one) and a["exp_expert"][i] % 2 == 0
             and a["exp_layer"][i] == a["exp_layer"][i + 1]
             and a["r_file"][rp[i]] == a["r_file"][rp[i + 1]] and only in (None, i)]
    for i, j in pairs:
        for col, ptr in (("t_offset", tp), ("t_xxh3", tp), ("r_start", rp), ("r_end", rp)):
            x, y = a[col][ptr[i]:ptr[i + 1]].copy(), a[col][ptr[j]:ptr[j + 1]].copy()
            a[col][ptr[i]:ptr[i + 1]], a[col][ptr[j]:ptr[j + 1]] = y, x
        a["exp_xxh3"][[i, j]] = a["exp_xxh3"][[j, i]]
    assert pairs, "no expert pair to swap"
    return write(meta, a, out)


def _bytes(repo_dir: Path, file: str, start: int, end: int) -> bytes:
    with open(repo_dir / file, "rb") as f:
        f.seek(start)
        return f.read(end - start)


def _rehash(meta: dict[str, Any], a: Arrays, repo_dir: Path, rows: list[int]) -> None:
    """The xxh3 of ``rows``' tensors and experts, from the bytes their (altered) ranges name."""
    files = [f[0] for f in meta["files"]]
    tp, rp = _ptrs(a)
    for i in rows:
        for t in range(tp[i], tp[i + 1]):
            off, nb = int(a["t_offset"][t]), int(a["t_nbytes"][t])
            data = _bytes(repo_dir, files[a["t_file"][t]], off, off + nb)
            a["t_xxh3"][t] = np.frombuffer(xxhash.xxh3_128(data).digest(), np.uint8)
        whole = b"".join(_bytes(repo_dir, files[a["r_file"][r]], int(a["r_start"][r]),
                                int(a["r_end"][r])) for r in range(rp[i], rp[i + 1]))
        a["exp_xxh3"][i] = np.frombuffer(xxhash.xxh3_128(whole).digest(), np.uint8)


def shift_range(src: Path, out: Path, repo_dir: Path) -> Path:
    """The first expert's range (and its tensors) one byte later, its hashes those of the bytes
    now named. It overlaps the tensor after it, which the structural checks catch."""
    meta, a = read(src)
    tp, rp = _ptrs(a)
    a["r_start"][rp[0]:rp[1]] += 1
    a["r_end"][rp[0]:rp[1]] += 1
    a["t_offset"][tp[0]:tp[1]] += 1
    _rehash(meta, a, repo_dir, [0])
    return write(meta, a, out, check=False)


def shift_shard(src: Path, out: Path, repo_dir: Path) -> Path:
    """Every tensor of the first shard holding experts one byte earlier (into its header, whose
    length the manifest then gives one byte short), every hash that of the bytes now named:
    self-consistent, so nothing but the shard's own header can tell."""
    meta, a = read(src)
    shard = int(a["r_file"][0])
    name = meta["files"][shard][0]
    meta["files"][shard][3] -= 1
    for r in meta["resident"]:
        if r[3] == name:
            r[4] -= 1
            r[6] = xxhash.xxh3_128(_bytes(repo_dir, name, r[4], r[4] + r[5])).hexdigest()
    a["t_offset"][a["t_file"] == shard] -= 1
    a["r_start"][a["r_file"] == shard] -= 1
    a["r_end"][a["r_file"] == shard] -= 1
    tp, rp = _ptrs(a)
    rows = sorted({int(np.searchsorted(rp, r, "right") - 1)
                   for r in np.flatnonzero(a["r_file"] == shard)})
    _rehash(meta, a, repo_dir, rows)
    return write(meta, a, out)


def wrong_hash(src: Path, out: Path, row: int) -> Path:
    """One expert's xxh3 changed: its layout is right, only its hash is wrong."""
    meta, a = read(src)
    a["exp_xxh3"][row] ^= 0xFF
    return write(meta, a, out)


def alias_digests(src: Path, out: Path, aliases: dict[int, int]) -> Path:
    """Row ``i`` given row ``aliases[i]``'s hashes (the expert's and its tensors'), its ranges and
    layout left honest: the header check passes, and only the bytes of row ``i``'s own ranges
    can tell that they do not hash to what the manifest says."""
    meta, a = read(src)
    tp, _ = _ptrs(a)
    old = {k: a[k].copy() for k in ("exp_xxh3", "t_xxh3")}
    for i, j in aliases.items():
        a["exp_xxh3"][i] = old["exp_xxh3"][j]
        assert tp[i + 1] - tp[i] == tp[j + 1] - tp[j], "rows of different tensor counts"
        a["t_xxh3"][tp[i]:tp[i + 1]] = old["t_xxh3"][tp[j]:tp[j + 1]]
    return write(meta, a, out)


def alias_layer(src: Path, out: Path, layer: int) -> Path:
    """Every expert of ``layer`` given the hashes of the next one (the last the first's)."""
    m = Manifest.load(src)
    rows = [m.row(layer, e) for e in range(m.experts_per_layer)]
    return alias_digests(src, out, {r: rows[(k + 1) % len(rows)] for k, r in enumerate(rows)})


def hashes_from(src: Path, out: Path, other: Path, rows: list[int]) -> Path:
    """``rows`` given the hashes ``other`` (another revision's manifest) has for them: a new
    revision that says these experts did not change, its ranges and layout honest."""
    meta, a = read(src)
    _, b = read(other)
    tp, _ = _ptrs(a)
    for i in rows:
        a["exp_xxh3"][i] = b["exp_xxh3"][i]
        a["t_xxh3"][tp[i]:tp[i + 1]] = b["t_xxh3"][tp[i]:tp[i + 1]]
    return write(meta, a, out)


def swap_names_in_header(shard: Path, first: Any, second: Any) -> None:
    """Exchange the names of two experts' tensors in ``shard``'s safetensors header, in place:
    the same bytes, the same header length, each expert's data now under the other's names."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = raw[8:8 + n]
    for x, y in zip(first.tensors, second.tensors, strict=True):
        a, b = f'"{x.name}"'.encode(), f'"{y.name}"'.encode()
        hold = b'"' + b"#" * (len(a) - 2) + b'"'
        assert head.count(a) == 1 and head.count(b) == 1 and len(a) == len(b)
        head = head.replace(a, hold).replace(b, a).replace(hold, b)
    shard.write_bytes(raw[:8] + head + raw[8 + n:])
