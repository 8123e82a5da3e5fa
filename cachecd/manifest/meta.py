"""Manifest meta (the JSON half): the expert naming rule and the checks of files, vocabularies
and resident tensors. It imports nothing else of the manifest but the dtype table and the repo rule.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from cachecd import constants, errors
from cachecd.manifest.dtypes import DTYPE_BITS
from cachecd.manifest.repo_ref import valid_repo

# group 1 = layer, group 2 = expert; everything that does not match is resident.
EXPERT_PATTERN = r"(?:^|\.)layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
EXPERT_RE = re.compile(EXPERT_PATTERN)
FORMAT_NAME = "cachecd-manifest"
HEX40 = re.compile(r"[0-9a-f]{40}")
HEX64 = re.compile(r"[0-9a-f]{64}")
# How a manifest was made (the optional meta key "made"), as shown by `manifest verify` and
# `status`. Only a full pass makes its hashes the revision's own; whoever made it says so here,
# so the word of a manifest you did not build is its publisher's.
MADE = {
    "full-pass": "by a full pass (cachecd manifest build): every tensor's and expert's xxh3-128 "
                 "computed from the shards' bytes, each shard's sha256 in the same pass",
    "headers": "by setup from the shards' safetensors headers, each proven through Xet against "
               "the Hub's hash of its shard at the commit: no expert's digest is known until its "
               "bytes are proven on their first fetch (the daemon learns it then)",
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


_EXPERT_FIELD = re.compile(r"experts\[(\d+)\]")
# Sizes, offsets and element counts fit numpy's int64 with room (a bigger one would raise
# OverflowError where the columns are checked): no file or tensor comes near 2**59 bytes.
LIMIT = 1 << 59


def _count(x: Any) -> bool:
    """A non-negative int below ``LIMIT`` (bool is not one)."""
    return type(x) is int and 0 <= x < LIMIT


def _shape(s: Any) -> bool:
    return (isinstance(s, list) and len(s) <= 16 and all(_count(x) for x in s)
            and math.prod(s) < LIMIT)


class Ctx:
    def __init__(self, source: str, meta: dict[str, Any]) -> None:
        self.source, self.meta = source, meta
        self.rows: tuple[Any, Any] | None = None  # (layer, expert) columns, once checked

    def fail(self, field: str, msg: str) -> errors.ManifestInvalid:
        """The error naming the file and the field, and the expert a row field is about."""
        return errors.ManifestInvalid(f"{self.source}: {self.named(field)}: {msg}")

    def named(self, field: str) -> str:
        """``experts[12].ranges[0]`` as ``experts[12].ranges[0] (layer 1 expert 5)``."""
        m = _EXPERT_FIELD.match(field)
        if m and self.rows is not None and int(m[1]) < len(self.rows[0]):
            row = int(m[1])
            return f"{field} (layer {self.rows[0][row]} expert {self.rows[1][row]})"
        return field

    def expert_field(self, row: int, field: str) -> str:
        return f"experts[{row}].{field}"


# -- meta ----------------------------------------------------------------------------------
def check_meta(ctx: Ctx, meta: Any) -> None:
    if not isinstance(meta, dict):
        raise ctx.fail("meta", "not a JSON object")
    for key, typ in META_TYPES.items():
        if key not in meta:
            raise ctx.fail(key, "missing")
        if not isinstance(meta[key], typ) or isinstance(meta[key], bool):
            raise ctx.fail(key, f"expected {getattr(typ, '__name__', typ)}, got {meta[key]!r:.80}")
    if meta["format"] != FORMAT_NAME:
        raise ctx.fail("format", f"{meta['format']!r} is not a cachecd manifest")
    if meta["format_version"] != constants.MANIFEST_FORMAT_VERSION:
        raise ctx.fail(
            "format_version",
            f"{meta['format_version']} is not supported (this cachecd reads "
            f"{constants.MANIFEST_FORMAT_VERSION}); upgrade cachecd or rebuild the manifest",
        )
    if not valid_repo(meta["repo"]):
        raise ctx.fail("repo", f"{meta['repo']!r} is not ORG/NAME")
    if not HEX40.fullmatch(meta["revision"]):
        raise ctx.fail(
            "revision", f"{meta['revision']!r} is not a 40-hex commit (pin a commit, not a branch)"
        )
    if meta["config_sha256"] and not HEX64.fullmatch(meta["config_sha256"]):
        raise ctx.fail("config_sha256", f"{meta['config_sha256']!r} is not a 64-hex sha256")
    if meta["expert_pattern"] != EXPERT_PATTERN:
        raise ctx.fail(
            "expert_pattern", "differs from this cachecd's expert naming; rebuild the manifest"
        )
    if not _count(meta["experts_per_layer"]):
        raise ctx.fail("experts_per_layer", f"{meta['experts_per_layer']} is not in 0..2**59")
    if "made" in meta and (not isinstance(meta["made"], str) or meta["made"] not in MADE):
        raise ctx.fail("made", f"{meta['made']!r:.80} is not one of {sorted(MADE)}")
    _check_files(ctx, meta["files"])
    _check_vocab(ctx, meta)
    _check_resident(ctx, meta)


def _check_files(ctx: Ctx, files: list[Any]) -> None:
    prev = None
    for i, f in enumerate(files):
        field = f"files[{i}]"
        if not (
            isinstance(f, list)
            and len(f) == 4
            and isinstance(f[0], str)
            and all(_count(x) for x in (f[1], f[3]))
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


def _check_vocab(ctx: Ctx, meta: dict[str, Any]) -> None:
    for i, d in enumerate(meta["dtypes"]):
        if not isinstance(d, str) or d not in DTYPE_BITS:
            raise ctx.fail(f"dtypes[{i}]", f"unknown safetensors dtype {d!r:.40}")
    for i, s in enumerate(meta["shapes"]):
        if not _shape(s):
            raise ctx.fail(f"shapes[{i}]", f"not a list of non-negative ints whose product "
                           f"is below 2**59: {s!r:.80}")
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


def _check_template(ctx: Ctx, i: int, t: list[str]) -> None:
    sample = f"{t[0]}7{t[1]}11{t[2]}"
    m = EXPERT_RE.search(sample)
    ok = m is not None and m.groups() == ("7", "11") and m.start(1) == len(t[0])
    if not ok:
        raise ctx.fail(f"templates[{i}]", f"{sample!r} does not name a routed expert tensor")


def _check_resident(ctx: Ctx, meta: dict[str, Any]) -> None:
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
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise ctx.fail(f"{field}.dtype", f"{name}: unknown dtype {dtype!r:.40}")
        if not _shape(shape):
            raise ctx.fail(f"{field}.shape", f"{name}: bad shape {shape!r:.80}")
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{32}", digest)):
            raise ctx.fail(
                f"{field}.xxh3", f"{name}: digest must be 16 bytes (32 hex), got {digest!r:.80}"
            )
        if not isinstance(file, str) or file not in files or files[file][3] == 0:
            raise ctx.fail(
                f"{field}.file", f"{name}: {file!r:.120} is not a safetensors shard of the manifest"
            )
        if not (_count(offset) and _count(nbytes)):
            raise ctx.fail(field, f"{name}: offset/nbytes must be integers in 0..2**59")
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
