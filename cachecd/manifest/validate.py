"""Validation of a manifest archive (meta JSON + numpy columns), vectorised with numpy.

Every failure raises ``errors.ManifestInvalid`` whose message names the source file and the
field (``x.manifest: experts[12].ranges[0]: end 1234 past the end of f.safetensors (size 1000)``).
On success the arrays are returned in canonical dtypes together with the derived CSR pointers
and per-tensor blob offsets, so ``Manifest`` never re-derives them. See ``manifest`` for the
invariants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cachecd.manifest.meta import DTYPE_BITS, EXPERT_RE, Ctx, check_meta

# name -> (numpy dtype it is stored as, number of dimensions); row counts are checked below.
COLUMNS: dict[str, tuple[type, int]] = {
    "exp_layer": (np.int32, 1),
    "exp_expert": (np.int32, 1),
    "exp_nbytes": (np.int64, 1),
    "exp_xxh3": (np.uint8, 2),
    "exp_ntensors": (np.int32, 1),
    "exp_nranges": (np.int32, 1),
    "t_template": (np.int32, 1),
    "t_file": (np.int32, 1),
    "t_offset": (np.int64, 1),
    "t_nbytes": (np.int64, 1),
    "t_dtype": (np.int32, 1),
    "t_shape": (np.int32, 1),
    "t_xxh3": (np.uint8, 2),
    "r_file": (np.int32, 1),
    "r_start": (np.int64, 1),
    "r_end": (np.int64, 1),
}


@dataclass
class Checked:
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    tensor_ptr: np.ndarray  # int64 [N+1]: tensors of row i are [ptr[i], ptr[i+1])
    range_ptr: np.ndarray  # int64 [N+1]
    blob_offsets: np.ndarray  # int64 [T]: offset of each tensor inside its expert's bytes
    split_experts: int  # experts whose ranges span more than one file


def check_archive(meta: Any, arrays: dict[str, np.ndarray], source: str) -> Checked:
    ctx = Ctx(source, meta)
    check_meta(ctx, meta)
    a = _check_columns(ctx, arrays)
    ctx.rows = (a["exp_layer"], a["exp_expert"])
    t_ptr, r_ptr = _check_rows(ctx, a)
    _check_references(ctx, a)
    _check_tensor_sizes(ctx, a, t_ptr)
    _check_ranges(ctx, a, r_ptr)
    blob = _check_tiling(ctx, a, t_ptr, r_ptr)
    _check_templates(ctx, a, t_ptr)
    _check_overlaps(ctx, a, r_ptr)
    for arr in a.values():
        arr.flags.writeable = False
    rows = np.repeat(np.arange(len(a["exp_layer"]), dtype=np.int64), np.diff(r_ptr))
    change = (a["r_file"][1:] != a["r_file"][:-1]) & (rows[1:] == rows[:-1])
    split = len(np.unique(rows[1:][change]))
    return Checked(meta, a, t_ptr, r_ptr, blob, split)


# -- columns -------------------------------------------------------------------------------
def _check_columns(ctx: Ctx, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, (dtype, ndim) in COLUMNS.items():
        arr = arrays.get(name)
        if arr is None:
            raise ctx.fail(name, "column missing")
        if arr.ndim != ndim or (arr.size and arr.dtype.kind not in "iu"):
            raise ctx.fail(
                name, f"expected a {ndim}-d integer array, got {arr.dtype}{list(arr.shape)}"
            )
        if ndim == 2 and arr.shape[1] != 16:
            table = "experts" if name.startswith("exp") else "tensors"
            raise ctx.fail(
                f"{table}.xxh3", f"digests are {arr.shape[1]} bytes, expected 16 (xxh3-128)"
            )
        out[name] = np.ascontiguousarray(arr, dtype=dtype)
        if arr.size and not np.array_equal(out[name], arr):
            raise ctx.fail(name, "values out of range")
    extra = set(arrays) - set(COLUMNS)
    if extra:
        raise ctx.fail(min(extra), "unknown column (written by a newer cachecd?)")
    for prefix, table in (("exp_", "exp_layer"), ("t_", "t_file"), ("r_", "r_file")):
        n = len(out[table])
        for name in COLUMNS:
            if name.startswith(prefix) and len(out[name]) != n:
                raise ctx.fail(name, f"{len(out[name])} rows, expected {n} like {table}")
    return out


def _check_rows(ctx: Ctx, a: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    layer, expert, n_per = a["exp_layer"], a["exp_expert"], ctx.meta["experts_per_layer"]
    ptrs = []
    for col, table in (("exp_ntensors", "t_file"), ("exp_nranges", "r_file")):
        counts = a[col]
        bad = np.flatnonzero(counts < 1)
        if bad.size:
            raise ctx.fail(ctx.expert_field(int(bad[0]), col[4:]), "an expert needs at least one")
        ptr = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=ptr[1:])
        if ptr[-1] != len(a[table]):
            raise ctx.fail(col, f"counts add up to {ptr[-1]}, the table has {len(a[table])} rows")
        ptrs.append(ptr)
    if len(layer) == 0:
        return ptrs[0], ptrs[1]
    if n_per < 1 or len(layer) % n_per:
        raise ctx.fail("experts_per_layer", f"{n_per} does not divide the {len(layer)} experts")
    want_expert = np.tile(np.arange(n_per, dtype=np.int32), len(layer) // n_per)
    layer_blocks = layer.reshape(-1, n_per)
    bad = np.flatnonzero((expert != want_expert) | (layer != np.repeat(layer_blocks[:, 0], n_per)))
    if bad.size == 0 and np.any(np.diff(layer_blocks[:, 0]) <= 0):
        bad = np.array([n_per * int(np.flatnonzero(np.diff(layer_blocks[:, 0]) <= 0)[0] + 1)])
    if bad.size:
        i = int(bad[0])
        raise ctx.fail(
            f"experts[{i}]",
            f"layer {layer[i]} expert {expert[i]} out of order: rows must be "
            f"sorted by (layer, expert) with experts 0..{n_per - 1} in every MoE layer",
        )
    if layer[0] < 0:
        raise ctx.fail("experts[0].layer", "negative")
    return ptrs[0], ptrs[1]


def _check_references(ctx: Ctx, a: dict[str, np.ndarray]) -> None:
    meta = ctx.meta
    is_shard = np.array([f[3] > 0 for f in meta["files"]], bool)
    limits = (
        ("t_template", "templates"),
        ("t_dtype", "dtypes"),
        ("t_shape", "shapes"),
        ("t_file", "files"),
        ("r_file", "files"),
    )
    for col, key in limits:
        bad = np.flatnonzero((a[col] < 0) | (a[col] >= len(meta[key])))
        if bad.size:
            raise ctx.fail(
                f"{col}[{bad[0]}]", f"index {a[col][bad[0]]} outside {key} ({len(meta[key])})"
            )
    for col in ("t_file", "r_file"):
        bad = np.flatnonzero(~is_shard[a[col]]) if len(a[col]) else np.array([], np.int64)
        if bad.size:
            name = meta["files"][a[col][bad[0]]][0]
            raise ctx.fail(f"{col}[{bad[0]}]", f"{name} is not a safetensors shard of the manifest")


def _check_tensor_sizes(ctx: Ctx, a: dict[str, np.ndarray], t_ptr: np.ndarray) -> None:
    meta = ctx.meta
    bits = np.array([DTYPE_BITS[d] for d in meta["dtypes"]] or [0], np.int64)
    numel = np.array([int(np.prod(s, dtype=np.int64)) for s in meta["shapes"]] or [0], np.int64)
    want_bits = bits[a["t_dtype"]] * numel[a["t_shape"]]
    bad = np.flatnonzero((a["t_nbytes"] * 8 != want_bits) | (a["t_nbytes"] <= 0))
    if bad.size:
        t = int(bad[0])
        row = int(np.searchsorted(t_ptr, t, "right") - 1)
        dtype, shape = meta["dtypes"][a["t_dtype"][t]], meta["shapes"][a["t_shape"][t]]
        raise ctx.fail(
            ctx.expert_field(row, f"tensors[{t - t_ptr[row]}].nbytes"),
            f"{a['t_nbytes'][t]} disagrees with {dtype}{shape} = {want_bits[t] / 8:g} bytes "
            "(expert tensors must be non-empty)",
        )


def _range_at(ctx: Ctx, r_ptr: np.ndarray, r: int) -> str:
    row = int(np.searchsorted(r_ptr, r, "right") - 1)
    return ctx.expert_field(row, f"ranges[{r - r_ptr[row]}]")


def _check_ranges(ctx: Ctx, a: dict[str, np.ndarray], r_ptr: np.ndarray) -> None:
    files = ctx.meta["files"]
    size = np.array([f[1] for f in files] or [0], np.int64)
    data0 = np.array([8 + f[3] for f in files] or [0], np.int64)
    f, s, e = a["r_file"], a["r_start"], a["r_end"]
    checks = (
        (s >= e, lambda r: f"empty or reversed: start {s[r]} end {e[r]}"),
        (e > size[f], lambda r: f"end {e[r]} past the end of {files[f[r]][0]} (size {size[f[r]]})"),
        (
            s < data0[f],
            lambda r: (
                f"start {s[r]} inside the header of {files[f[r]][0]} (data starts at {data0[f[r]]})"
            ),
        ),
    )
    for mask, msg in checks:
        bad = np.flatnonzero(mask)
        if bad.size:
            raise ctx.fail(_range_at(ctx, r_ptr, int(bad[0])), msg(int(bad[0])))
    # Within an expert: ordered by (file, start), maximal (a gap between consecutive ranges).
    same = np.ones(len(f), bool)
    same[r_ptr[:-1][np.diff(r_ptr) > 0]] = False
    nxt = np.flatnonzero(same[1:]) + 1
    bad = nxt[(f[nxt] < f[nxt - 1]) | ((f[nxt] == f[nxt - 1]) & (s[nxt] <= e[nxt - 1]))]
    if bad.size:
        raise ctx.fail(
            _range_at(ctx, r_ptr, int(bad[0])),
            "not after the previous range in (shard order, start) or touches it",
        )
    lengths = np.add.reduceat(e - s, r_ptr[:-1]) if len(s) else np.zeros(0, np.int64)
    bad = np.flatnonzero(lengths != a["exp_nbytes"])
    if bad.size:
        row = int(bad[0])
        raise ctx.fail(
            ctx.expert_field(row, "nbytes"),
            f"{a['exp_nbytes'][row]} != {lengths[row]}, the sum of its ranges",
        )


def _check_tiling(
    ctx: Ctx, a: dict[str, np.ndarray], t_ptr: np.ndarray, r_ptr: np.ndarray
) -> np.ndarray:
    """The tensors, laid end to end, are exactly the ranges concatenated: returns blob offsets."""
    nb = a["t_nbytes"]
    t_pos = np.cumsum(nb) - nb  # global position of each tensor in all blobs back to back
    r_len = a["r_end"] - a["r_start"]
    r_pos = np.cumsum(r_len) - r_len
    sums = np.add.reduceat(nb, t_ptr[:-1]) if len(nb) else np.zeros(0, np.int64)
    bad = np.flatnonzero(sums != a["exp_nbytes"])
    if bad.size:
        row = int(bad[0])
        raise ctx.fail(
            ctx.expert_field(row, "tensors"),
            f"add up to {sums[row]} bytes but the expert has {a['exp_nbytes'][row]}",
        )
    if len(nb) == 0:
        return np.zeros(0, np.int64)
    j = np.searchsorted(r_pos, t_pos, "right") - 1
    inside = t_pos - r_pos[j]
    ok = (
        (a["r_file"][j] == a["t_file"])
        & (a["t_offset"] == a["r_start"][j] + inside)
        & (a["t_offset"] + nb <= a["r_end"][j])
    )
    bad = np.flatnonzero(~ok)
    if bad.size:
        t = int(bad[0])
        row = int(np.searchsorted(t_ptr, t, "right") - 1)
        raise ctx.fail(
            ctx.expert_field(row, f"tensors[{t - t_ptr[row]}].offset"),
            f"{a['t_offset'][t]} in {ctx.meta['files'][a['t_file'][t]][0]} is not where the "
            "expert's ranges put it (tensors must tile the ranges in order)",
        )
    return t_pos - np.repeat(t_pos[t_ptr[:-1]], np.diff(t_ptr))


def _check_templates(ctx: Ctx, a: dict[str, np.ndarray], t_ptr: np.ndarray) -> None:
    """Names are unique: no template twice in one expert; literal names belong to their row."""
    tpl = a["t_template"]
    if len(tpl) == 0:
        return
    row = np.repeat(np.arange(len(t_ptr) - 1, dtype=np.int64), np.diff(t_ptr))
    order = np.lexsort((tpl, row))
    dup = np.flatnonzero((row[order][1:] == row[order][:-1]) & (tpl[order][1:] == tpl[order][:-1]))
    if dup.size:
        r = int(row[order][dup[0]])
        raise ctx.fail(ctx.expert_field(r, "tensors"), "the same tensor name twice")
    literal = [i for i, t in enumerate(ctx.meta["templates"]) if len(t) == 1]
    for t in np.flatnonzero(np.isin(tpl, literal)):
        r = int(row[t])
        name = ctx.meta["templates"][tpl[t]][0]
        m = EXPERT_RE.search(name)
        if m is None or (int(m.group(1)), int(m.group(2))) != (
            a["exp_layer"][r],
            a["exp_expert"][r],
        ):
            raise ctx.fail(
                ctx.expert_field(r, f"tensors[{t - t_ptr[r]}].name"),
                f"{name!r} is not a tensor of layer {a['exp_layer'][r]} expert {a['exp_expert'][r]}",
            )


def _check_overlaps(ctx: Ctx, a: dict[str, np.ndarray], r_ptr: np.ndarray) -> None:
    """No byte belongs to two ranges or resident tensors; files laid end to end make it 1-d."""
    files = ctx.meta["files"]
    index = {f[0]: i for i, f in enumerate(files)}
    res = ctx.meta["resident"]
    base = np.cumsum([0] + [f[1] for f in files], dtype=np.int64)
    f = np.concatenate(
        [a["r_file"].astype(np.int64), np.array([index[r[3]] for r in res], np.int64)]
    )
    s = base[f] + np.concatenate([a["r_start"], np.array([r[4] for r in res], np.int64)])
    e = base[f] + np.concatenate([a["r_end"], np.array([r[4] + r[5] for r in res], np.int64)])
    keep = np.flatnonzero(e > s)  # an empty resident tensor occupies nothing
    if len(keep) < 2:
        return
    order = keep[np.argsort(s[keep], kind="stable")]
    so, eo = s[order], e[order]
    prev_end = np.maximum.accumulate(eo)[:-1]
    bad = np.flatnonzero(so[1:] < prev_end)
    if bad.size == 0:
        return
    k = int(bad[0]) + 1
    other = int(np.flatnonzero(eo[:k] > so[k])[0])
    i, j, n = int(order[k]), int(order[other]), len(a["r_file"])
    name = files[f[i]][0]
    raise ctx.fail(
        _what(ctx, i, r_ptr, n),
        f"{name} {s[i] - base[f[i]]}..{e[i] - base[f[i]]} overlaps "
        f"{ctx.named(_what(ctx, j, r_ptr, n))} "
        f"{s[j] - base[f[j]]}..{e[j] - base[f[j]]}",
    )


def _what(ctx: Ctx, i: int, r_ptr: np.ndarray, n_ranges: int) -> str:
    if i < n_ranges:
        return _range_at(ctx, r_ptr, i)
    return f"resident[{i - n_ranges}] ({ctx.meta['resident'][i - n_ranges][0]})"
