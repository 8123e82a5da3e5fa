"""The layout check: a manifest's tensors against the safetensors headers of its shards.

Every routed expert's tensors (name, shard, offset, size, dtype, shape) and every resident tensor
must be where the shards' own headers at the pinned commit put them, each shard's header length
must be the manifest's, and no tensor of a header may be missing from the manifest. An expert's
byte ranges are the maximal runs its tensors tile, in order (``validate``), so once this passes
every range is the bytes of the expert it names. A manifest can then be wrong only in its
xxh3-128 hashes, and a wrong hash makes the daemon refuse those bytes (``checksum_mismatch``),
never serve them.

Pure: the caller fetches (or keeps) the headers (``headers``). Problems are listed in row order,
one per wrong expert, so the first names the first wrong expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from cachecd import errors
from cachecd.manifest.manifest import Manifest, parse_expert_name
from cachecd.manifest.safetensors_header import HeaderColumns, parse_header_columns


def check_layout(manifest: Manifest, headers: Mapping[str, bytes]) -> None:
    """Raise ``ManifestMismatch`` naming the first wrong expert (or tensor) and what to do."""
    found = layout_problems(manifest, headers)
    if found:
        raise mismatch(manifest, found)


def mismatch(manifest: Manifest, found: list[str]) -> errors.ManifestMismatch:
    """The one-line error for ``layout_problems``' findings (not empty)."""
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return errors.ManifestMismatch(
        f"{manifest.source}: {found[0]}{more}. Its byte ranges are not the tensors the shards' "
        f"own headers at {manifest.revision} name: it would serve other bytes than the experts "
        f"it names; do not use it; build one (cachecd manifest build {manifest.key}) or get it "
        "again from its publisher")


def layout_problems(manifest: Manifest, headers: Mapping[str, bytes]) -> list[str]:
    """Every disagreement with the headers: experts in row order (one line per wrong expert),
    then resident tensors, header tensors the manifest lacks, and shards' header lengths."""
    shards: list[str] = []
    h = _Headers(manifest, headers, shards)
    names, cols, rows = manifest.tensor_table()
    cols = cols.copy()
    cols[:, 3], cols[:, 4] = h.dtype_canon[cols[:, 3]], h.shape_canon[cols[:, 4]]
    at = np.array([h.index.get(name, -1) for name in names], np.int64)
    got = h.columns[at] if len(at) else np.zeros((0, 5), np.int64)
    got[at < 0] = -2
    bad = np.flatnonzero((got != cols).any(axis=1)) if len(names) else at
    first_per_row = bad[np.unique(rows[bad], return_index=True)[1]] if bad.size else bad
    out = [_expert_problem(manifest, int(rows[t]), names[t], cols[t], h)
           for t in first_per_row.tolist()]
    out += _resident_problems(manifest, h)
    claimed = int(np.count_nonzero(at >= 0)) + sum(1 for t in manifest.resident
                                                  if t.name in h.index)
    if claimed != len(h.index):
        known = set(names) | {t.name for t in manifest.resident}
        out += [_unclaimed(name, h.shard_of(name)) for name in sorted(set(h.index) - known)]
    return out + shards


class _Headers:
    """Every tensor of every shard's header: by name (``index``), as the manifest's columns see
    it (``columns``: file index, offset, nbytes, canonical dtype and shape ids, -1 for one the
    manifest has no word for), and as the header says it."""

    def __init__(self, manifest: Manifest, headers: Mapping[str, bytes], out: list[str]) -> None:
        self.dtype_canon, dtype_id = _canon(manifest.dtype_names)
        self.shape_canon, shape_id = _canon(manifest.shape_list)
        file_index = {name: i for i, name in enumerate(manifest.file_names)}
        self.index: dict[str, int] = {}
        self.parsed: list[tuple[str, HeaderColumns]] = []
        blocks = []
        for shard in manifest.shards:
            info = manifest.files[shard]
            n, cols = parse_header_columns(headers[shard], info.size, shard)
            if n != info.header_len:
                out.append(f"{shard}: its safetensors header is {n} bytes at "
                           f"{manifest.revision}, the manifest says {info.header_len}")
            base = sum(len(c.names) for _, c in self.parsed)
            for i, name in enumerate(cols.names):
                if self.index.setdefault(name, base + i) != base + i:
                    out.append(f"{name}: in the headers of both {self.shard_of(name)} and {shard}")
            self.parsed.append((shard, cols))
            blocks.append(np.column_stack([
                np.full(len(cols.names), file_index[shard], np.int64), cols.starts,
                cols.ends - cols.starts,
                np.array([dtype_id.get(d, -1) for d in cols.dtypes], np.int64),
                np.array([shape_id.get(sh, -1) for sh in cols.shapes], np.int64)]))
        self.columns = np.concatenate(blocks) if blocks else np.zeros((0, 5), np.int64)

    def find(self, name: str) -> tuple[str, int, int, str, tuple[int, ...]] | None:
        """(shard, offset, nbytes, dtype, shape) as the header has the tensor, if any has it."""
        i = self.index.get(name)
        if i is None:
            return None
        for shard, c in self.parsed:
            if i < len(c.names):
                return shard, int(c.starts[i]), int(c.ends[i] - c.starts[i]), c.dtypes[i], c.shapes[i]
            i -= len(c.names)
        raise AssertionError(name)

    def shard_of(self, name: str) -> str:
        found = self.find(name)
        return found[0] if found else "?"


def _canon(values: list[Any]) -> tuple[np.ndarray, dict[Any, int]]:
    """Each vocabulary entry's first index (a vocabulary may repeat a value), and value -> it."""
    first: dict[Any, int] = {}
    for i, v in enumerate(values):
        first.setdefault(v, i)
    return np.array([first[v] for v in values] or [0], np.int64), first


def _expert_problem(manifest: Manifest, row: int, name: str, want: np.ndarray,
                    h: _Headers) -> str:
    layer, expert = int(manifest.layer_ids[row]), int(manifest.expert_ids[row])
    f, offset, nbytes, dtype, shape = (int(x) for x in want)
    said = _where(manifest.file_names[f], offset, nbytes, manifest.dtype_names[dtype],
                  manifest.shape_list[shape])
    found = h.find(name)
    if found is None:
        return (f"layer {layer} expert {expert}: its tensor {name} ({said} in the manifest) is in "
                f"no shard's header at {manifest.revision}")
    return (f"layer {layer} expert {expert}: its tensor {name} is {said} in the manifest, "
            f"{_where(*found)} in that commit's headers")


def _where(file: str, offset: int, nbytes: int, dtype: str, shape: Any) -> str:
    return f"{file} bytes {offset}..{offset + nbytes} ({dtype} {list(shape)})"


def _resident_problems(manifest: Manifest, h: _Headers) -> list[str]:
    out = []
    for t in manifest.resident:
        said = _where(t.file, t.offset, t.nbytes, t.dtype, t.shape)
        found = h.find(t.name)
        if found is None:
            out.append(f"resident tensor {t.name} ({said} in the manifest): in no shard's header "
                       f"at {manifest.revision}")
        elif found != (t.file, t.offset, t.nbytes, t.dtype, tuple(t.shape)):
            out.append(f"resident tensor {t.name}: {said} in the manifest, {_where(*found)} in "
                       "that commit's headers")
    return out


def _unclaimed(name: str, shard: str) -> str:
    key = parse_expert_name(name)
    whose = f"layer {key[0]} expert {key[1]}" if key else "a resident tensor"
    return f"{shard}: its header names {name} ({whose}), which the manifest lacks"
