"""Validation of a manifest archive (meta JSON + numpy columns), vectorised with numpy.

Every failure raises ``errors.ManifestInvalid`` whose message names the source file and the
field (``x.manifest: experts[12].ranges[0]: end 1234 past the end of f.safetensors (size 1000)``).
On success the arrays are returned in canonical dtypes together with the derived CSR pointers
and per-tensor blob offsets, so ``Manifest`` never re-derives them. See ``manifest`` for the
invariants.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachecd import constants, errors

HEX40 = re.compile(r"[0-9a-f]{40}")
HEX64 = re.compile(r"[0-9a-f]{64}")
REPO_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# Bits per element of each safetensors dtype (sub-byte float types pack).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
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
META_TYPES: dict[str, type | tuple[type, ...]] = {
    "format": str,
    "format_version": int,
    "repo": str,
    "revision": str,
    "model_type": str,
    "quant_format": str,
    "config_sha256": str,
    "files": list,
    "experts_per_layer": int,
    "expert_pattern": str,
    "dtypes": list,
    "shapes": list,
    "templates": list,
    "resident": list,
}


@dataclass
class Checked:
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    tensor_ptr: np.ndarray  # int64 [N+1]: tensors of row i are [ptr[i], ptr[i+1])
    range_ptr: np.ndarray  # int64 [N+1]
    blob_offsets: np.ndarray  # int64 [T]: offset of each tensor inside its expert's bytes
    split_experts: int  # experts whose ranges span more than one file


class _Ctx:
    def __init__(self, source: str, meta: dict[str, Any]) -> None:
        self.source, self.meta = source, meta

    def fail(self, field: str, msg: str) -> errors.ManifestInvalid:
        return errors.ManifestInvalid(f"{self.source}: {field}: {msg}")

    def expert_field(self, row: int, field: str) -> str:
        return f"experts[{row}].{field}"


def check_archive(meta: Any, arrays: dict[str, np.ndarray], source: str) -> Checked:
    ctx = _Ctx(source, meta)
    _check_meta(ctx, meta)
    a = _check_columns(ctx, arrays)
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


# -- meta ----------------------------------------------------------------------------------
def _check_meta(ctx: _Ctx, meta: Any) -> None:
    if not isinstance(meta, dict):
        raise ctx.fail("meta", "not a JSON object")
    for key, typ in META_TYPES.items():
        if key not in meta:
            raise ctx.fail(key, "missing")
        if not isinstance(meta[key], typ) or isinstance(meta[key], bool):
            raise ctx.fail(key, f"expected {getattr(typ, '__name__', typ)}, got {meta[key]!r:.80}")
    if meta["format"] != "cachecd-manifest":
        raise ctx.fail("format", f"{meta['format']!r} is not a cachecd manifest")
    if meta["format_version"] != constants.MANIFEST_FORMAT_VERSION:
        raise ctx.fail(
            "format_version",
            f"{meta['format_version']} is not supported (this cachecd reads "
            f"{constants.MANIFEST_FORMAT_VERSION}); upgrade cachecd or rebuild the manifest",
        )
    if not REPO_RE.fullmatch(meta["repo"]) or ".." in meta["repo"]:
        raise ctx.fail("repo", f"{meta['repo']!r} is not ORG/NAME")
    if not HEX40.fullmatch(meta["revision"]):
        raise ctx.fail(
            "revision", f"{meta['revision']!r} is not a 40-hex commit (pin a commit, not a branch)"
        )
    if meta["config_sha256"] and not HEX64.fullmatch(meta["config_sha256"]):
        raise ctx.fail("config_sha256", f"{meta['config_sha256']!r} is not a 64-hex sha256")
    from cachecd.manifest import EXPERT_PATTERN

    if meta["expert_pattern"] != EXPERT_PATTERN:
        raise ctx.fail(
            "expert_pattern", "differs from this cachecd's expert naming; rebuild the manifest"
        )
    if meta["experts_per_layer"] < 0:
        raise ctx.fail("experts_per_layer", "negative")
    _check_files(ctx, meta["files"])
    _check_vocab(ctx, meta)
    _check_resident(ctx, meta)


def _check_files(ctx: _Ctx, files: list[Any]) -> None:
    prev = None
    for i, f in enumerate(files):
        field = f"files[{i}]"
        if not (
            isinstance(f, list)
            and len(f) == 4
            and isinstance(f[0], str)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in (f[1], f[3]))
            and isinstance(f[2], str)
        ):
            raise ctx.fail(field, f"expected [name, size, sha256, header_len], got {f!r:.120}")
        name, size, sha, header_len = f
        if (
            not name
            or name.startswith("/")
            or ".." in name.split("/")
            or "\\" in name
            or "\0" in name
        ):
            raise ctx.fail(f"{field}.name", f"{name!r} is not a safe relative path")
        if prev is not None and name <= prev:
            raise ctx.fail(f"{field}.name", f"{name!r} is out of name order or repeated")
        if size < 0 or header_len < 0 or (header_len and 8 + header_len > size):
            raise ctx.fail(
                f"{field}", f"{name}: size {size} / header_len {header_len} inconsistent"
            )
        if not HEX64.fullmatch(sha):
            raise ctx.fail(f"{field}.sha256", f"{name}: {sha!r:.80} is not a 64-hex sha256")
        prev = name


def _check_vocab(ctx: _Ctx, meta: dict[str, Any]) -> None:
    for i, d in enumerate(meta["dtypes"]):
        if d not in DTYPE_BITS:
            raise ctx.fail(f"dtypes[{i}]", f"unknown safetensors dtype {d!r:.40}")
    for i, s in enumerate(meta["shapes"]):
        if not isinstance(s, list) or not all(isinstance(x, int) and x >= 0 for x in s):
            raise ctx.fail(f"shapes[{i}]", f"not a list of non-negative ints: {s!r:.80}")
    seen: set[tuple[str, ...]] = set()
    for i, t in enumerate(meta["templates"]):
        if not (isinstance(t, list) and len(t) in (1, 3) and all(isinstance(x, str) for x in t)):
            raise ctx.fail(
                f"templates[{i}]", f"expected [head, mid, tail] or [name], got {t!r:.80}"
            )
        if tuple(t) in seen:
            raise ctx.fail(f"templates[{i}]", "repeated")
        seen.add(tuple(t))
        if len(t) == 3:
            _check_template(ctx, i, t)


def _check_template(ctx: _Ctx, i: int, t: list[str]) -> None:
    from cachecd.manifest import EXPERT_RE

    sample = f"{t[0]}7{t[1]}11{t[2]}"
    m = EXPERT_RE.search(sample)
    ok = m is not None and m.groups() == ("7", "11") and m.start(1) == len(t[0])
    if not ok:
        raise ctx.fail(f"templates[{i}]", f"{sample!r} does not name a routed expert tensor")


def _check_resident(ctx: _Ctx, meta: dict[str, Any]) -> None:
    from cachecd.manifest import EXPERT_RE

    files = {f[0]: f for f in meta["files"]}
    names: set[str] = set()
    for i, r in enumerate(meta["resident"]):
        field = f"resident[{i}]"
        if not (isinstance(r, list) and len(r) == 7):
            raise ctx.fail(field, "expected [name, dtype, shape, file, offset, nbytes, xxh3]")
        name, dtype, shape, file, offset, nbytes, digest = r
        if not isinstance(name, str) or name in names or EXPERT_RE.search(name):
            raise ctx.fail(f"{field}.name", f"{name!r:.120} is repeated or names a routed expert")
        names.add(name)
        if dtype not in DTYPE_BITS:
            raise ctx.fail(f"{field}.dtype", f"{name}: unknown dtype {dtype!r:.40}")
        if not isinstance(shape, list) or not all(isinstance(x, int) and x >= 0 for x in shape):
            raise ctx.fail(f"{field}.shape", f"{name}: bad shape {shape!r:.80}")
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{32}", digest)):
            raise ctx.fail(
                f"{field}.xxh3", f"{name}: digest must be 16 bytes (32 hex), got {digest!r:.80}"
            )
        if file not in files or files[file][3] == 0:
            raise ctx.fail(
                f"{field}.file", f"{name}: {file!r:.120} is not a safetensors shard of the manifest"
            )
        if not (isinstance(offset, int) and isinstance(nbytes, int)):
            raise ctx.fail(field, f"{name}: offset/nbytes must be integers")
        want = DTYPE_BITS[dtype] * int(np.prod(shape, dtype=np.int64))
        if nbytes * 8 != want:
            raise ctx.fail(
                f"{field}.nbytes",
                f"{name}: {nbytes} disagrees with {dtype}{shape} = {want / 8:g} bytes",
            )
        _, size, _, header_len = files[file]
        if offset < 8 + header_len or offset + nbytes > size:
            raise ctx.fail(
                f"{field}.offset",
                f"{name}: {offset}..{offset + nbytes} outside the data of {file} (size {size})",
            )


# -- columns -------------------------------------------------------------------------------
def _check_columns(ctx: _Ctx, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
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


def _check_rows(ctx: _Ctx, a: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
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


def _check_references(ctx: _Ctx, a: dict[str, np.ndarray]) -> None:
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


def _check_tensor_sizes(ctx: _Ctx, a: dict[str, np.ndarray], t_ptr: np.ndarray) -> None:
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


def _range_at(ctx: _Ctx, r_ptr: np.ndarray, r: int) -> str:
    row = int(np.searchsorted(r_ptr, r, "right") - 1)
    return ctx.expert_field(row, f"ranges[{r - r_ptr[row]}]")


def _check_ranges(ctx: _Ctx, a: dict[str, np.ndarray], r_ptr: np.ndarray) -> None:
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
    ctx: _Ctx, a: dict[str, np.ndarray], t_ptr: np.ndarray, r_ptr: np.ndarray
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


def _check_templates(ctx: _Ctx, a: dict[str, np.ndarray], t_ptr: np.ndarray) -> None:
    """Names are unique: no template twice in one expert; literal names belong to their row."""
    from cachecd.manifest import EXPERT_RE

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


def _check_overlaps(ctx: _Ctx, a: dict[str, np.ndarray], r_ptr: np.ndarray) -> None:
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
        f"{name} {s[i] - base[f[i]]}..{e[i] - base[f[i]]} overlaps {_what(ctx, j, r_ptr, n)} "
        f"{s[j] - base[f[j]]}..{e[j] - base[f[j]]}",
    )


def _what(ctx: _Ctx, i: int, r_ptr: np.ndarray, n_ranges: int) -> str:
    if i < n_ranges:
        return _range_at(ctx, r_ptr, i)
    return f"resident[{i - n_ranges}] ({ctx.meta['resident'][i - n_ranges][0]})"
