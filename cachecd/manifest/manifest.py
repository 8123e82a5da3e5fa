"""Manifests: which bytes of one pinned model revision are which routed expert, with hashes.

An expert's bytes (the blob the store keeps, the bytes the daemon serves, the buffer the engine
parses) are ALWAYS its byte ranges concatenated in order, ranges ordered by (shard order, start);
shard order is the safetensors files sorted by name. Invariants, checked on every load
(vectorised in ``validate`` so a K3-sized manifest loads in well under a second):

- ``revision`` is a 40-hex commit; every digest is 16 bytes (xxh3-128).
- Rows are sorted by (layer, expert) and every MoE layer has experts 0..experts_per_layer-1.
- An expert's ranges are maximal contiguous runs inside the data section of a shard, and its
  tensors tile them exactly, in order; ``nbytes`` is the sum of the range lengths.
- No range or resident tensor overlaps another or runs past its file; every tensor's nbytes
  equals its dtype size times its shape.

The file is a zip written by numpy (``savez_compressed``, never pickle): a JSON ``meta`` plus
column arrays (experts, expert tensors, ranges). Expert tensor names are stored as a few
templates (head + layer + mid + expert + tail) and expand to the exact checkpoint names.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from cachecd import errors
from cachecd.durable import write_atomic
from cachecd.manifest import bounds
from cachecd.manifest.encode import build_meta, encode_experts
from cachecd.manifest.entries import ByteRange, ExpertEntry, FileInfo, TensorInfo
from cachecd.manifest.meta import EXPERT_PATTERN, EXPERT_RE, FORMAT_NAME, MADE
from cachecd.manifest.provenance import source_key
from cachecd.manifest.validate import Checked, check_archive

__all__ = [
    "EXPERT_PATTERN",
    "EXPERT_RE",
    "FORMAT_NAME",
]  # re-exported: the contract names them here

MANIFEST_SUFFIX = ".manifest"
ENTRY_CACHE_SIZE = 8192  # ~2 layers of K3; an entry is a few KB


def parse_expert_name(name: str) -> tuple[int, int] | None:
    """(layer, expert) for a routed-expert tensor name, None for a resident tensor."""
    m = EXPERT_RE.search(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


class Manifest:
    """One pinned revision of a model repo; immutable once built. See the module docstring."""

    def __init__(self, checked: Checked, source: str = "<memory>") -> None:
        meta, c = checked.meta, checked
        self.source = source
        self.format_version: int = meta["format_version"]
        self.repo: str = meta["repo"]
        self.revision: str = meta["revision"]
        self.model_type: str = meta["model_type"]
        self.quant_format: str = meta["quant_format"]
        self.config_sha256: str = meta["config_sha256"]
        self.made: str | None = MADE.get(meta.get("made", ""))  # how it was made, in words
        self.files: dict[str, FileInfo] = {
            f[0]: FileInfo(f[0], f[1], f[2], f[3]) for f in meta["files"]
        }
        self._file_names: list[str] = [f[0] for f in meta["files"]]
        self.shards: tuple[str, ...] = tuple(f[0] for f in meta["files"] if f[3] > 0)
        self.experts_per_layer: int = meta["experts_per_layer"]
        self.resident: tuple[TensorInfo, ...] = tuple(
            TensorInfo(r[0], r[1], tuple(r[2]), r[3], r[4], r[5], bytes.fromhex(r[6]))
            for r in meta["resident"]
        )
        self._meta = meta
        self._arrays = c.arrays
        self._dtypes: list[str] = meta["dtypes"]
        self._shapes: list[tuple[int, ...]] = [tuple(s) for s in meta["shapes"]]
        self._templates: list[list[str]] = meta["templates"]
        self._t_ptr, self._r_ptr, self._blob = c.tensor_ptr, c.range_ptr, c.blob_offsets
        self.layer_ids: np.ndarray = c.arrays["exp_layer"]
        self.expert_ids: np.ndarray = c.arrays["exp_expert"]
        self.sizes: np.ndarray = c.arrays["exp_nbytes"]
        # A manifest made from headers knows no expert's digest: each is learnt (``learn``) from
        # the expert's proven bytes. Its own copy, so the content (``content_sha256``) stays put.
        self.learns: bool = meta.get("made") == "headers"
        self.digests: np.ndarray = (c.arrays["exp_xxh3"].copy() if self.learns
                                    else c.arrays["exp_xxh3"])
        self._learnt: np.ndarray | None = (np.zeros(len(self.digests), dtype=bool)
                                           if self.learns else None)
        self.moe_layers: tuple[int, ...] = tuple(int(x) for x in np.unique(self.layer_ids))
        self._layer_base = {
            layer: i * self.experts_per_layer for i, layer in enumerate(self.moe_layers)
        }
        self.expert_bytes_total: int = int(self.sizes.sum())
        self.resident_bytes_total: int = sum(t.nbytes for t in self.resident)
        self.split_experts: int = c.split_experts
        # Row-major copies and Python lists so expert() is a few slices, not dozens.
        a = c.arrays
        cols = ("t_template", "t_dtype", "t_shape", "t_file", "t_offset", "t_nbytes")
        self._t_table = np.column_stack([a[k].astype(np.int64) for k in cols] + [self._blob])
        self._r_table = np.column_stack([a["r_file"].astype(np.int64), a["r_start"], a["r_end"]])
        self._t_ptr_list: list[int] = self._t_ptr.tolist()
        self._r_ptr_list: list[int] = self._r_ptr.tolist()
        self._layers_list: list[int] = self.layer_ids.tolist()
        self._experts_list: list[int] = self.expert_ids.tolist()
        self._sizes_list: list[int] = self.sizes.tolist()
        self._cache: dict[int, ExpertEntry] = {}
        self._content_sha256: str | None = None
        self._source_keys: list[str] | None = None

    # -- identity --------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return f"{self.repo}@{self.revision}"

    @property
    def n_experts(self) -> int:
        return int(self.layer_ids.shape[0])

    def __repr__(self) -> str:
        return f"Manifest({self.key}, experts={self.n_experts}, files={len(self.files)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Manifest):
            return NotImplemented
        if self._meta != other._meta or self._arrays.keys() != other._arrays.keys():
            return False
        return all(np.array_equal(v, other._arrays[k]) for k, v in self._arrays.items())

    __hash__ = None  # type: ignore[assignment]

    def content_sha256(self) -> str:
        """sha256 of everything the manifest says (meta and every column): equal manifests,
        and only those, have the same one."""
        if self._content_sha256 is None:
            h = hashlib.sha256(json.dumps(self._meta, sort_keys=True).encode())
            for name in sorted(self._arrays):
                arr = self._arrays[name]
                h.update(f"{name}:{arr.dtype.str}:{arr.shape}".encode())
                h.update(np.ascontiguousarray(arr).tobytes())
            self._content_sha256 = h.hexdigest()
        return self._content_sha256

    # -- lookups ---------------------------------------------------------------------------
    def row(self, layer: int, expert: int) -> int:
        base = self._layer_base.get(layer)
        if base is None or not 0 <= expert < self.experts_per_layer:
            raise errors.ExpertNotFound(
                f"{self.key} has no routed expert layer={layer} expert={expert} "
                f"(MoE layers {self.moe_layers[0]}..{self.moe_layers[-1]}, "
                f"{self.experts_per_layer} experts each)"
            )
        return base + expert

    def expert(self, layer: int, expert: int) -> ExpertEntry:
        return self.entry(self.row(layer, expert))

    def entry(self, row: int) -> ExpertEntry:
        """The expert at table row ``row`` (0 <= row < n_experts), built on demand; hot
        entries are kept (they are immutable, so sharing them is safe)."""
        hit = self._cache.get(row)
        if hit is None:
            if len(self._cache) >= ENTRY_CACHE_SIZE:
                self._cache.clear()  # cheap and bounded; a hot set refills in microseconds
            hit = self._cache[row] = self._build_entry(row)
        return hit

    def _build_entry(self, row: int) -> ExpertEntry:
        names, layer, expert = self._file_names, self._layers_list[row], self._experts_list[row]
        r0, r1 = self._r_ptr_list[row], self._r_ptr_list[row + 1]
        ranges = tuple(ByteRange(names[f], s, e) for f, s, e in self._r_table[r0:r1].tolist())
        t0, t1 = self._t_ptr_list[row], self._t_ptr_list[row + 1]
        digests = self._arrays["t_xxh3"][t0:t1].tobytes()
        rows = self._t_table[t0:t1].tolist()
        tensors = tuple(
            TensorInfo(
                self._tensor_name(tpl, layer, expert),
                self._dtypes[dt],
                self._shapes[sh],
                names[f],
                off,
                nb,
                digests[16 * i : 16 * i + 16],
            )
            for i, (tpl, dt, sh, f, off, nb, _) in enumerate(rows)
        )
        return ExpertEntry(
            layer,
            expert,
            self._sizes_list[row],
            self.digests[row].tobytes(),
            ranges,
            tensors,
            tuple(r[6] for r in rows),
            source_key(ranges, self.files),
        )

    def _tensor_name(self, template: int, layer: int, expert: int) -> str:
        parts = self._templates[template]
        if len(parts) == 1:  # a literal name (non-canonical digits such as "layers.03")
            return parts[0]
        return f"{parts[0]}{layer}{parts[1]}{expert}{parts[2]}"

    def experts(self) -> list[ExpertEntry]:
        """Every expert in row order (builds them all: for tools and tests, not hot paths)."""
        return [self.entry(i) for i in range(self.n_experts)]

    def tensor_table(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Every expert tensor in row order, without building entries: their names, their
        columns ``[file index, offset, nbytes, dtype, shape]`` (indices into ``files`` order,
        ``dtype_names`` and ``shape_list``) and the row each belongs to."""
        rows = np.repeat(np.arange(self.n_experts, dtype=np.int64), np.diff(self._t_ptr))
        tpl = self._t_table[:, 0].tolist()
        names = [self._tensor_name(t, self._layers_list[r], self._experts_list[r])
                 for t, r in zip(tpl, rows.tolist(), strict=True)]
        return names, self._t_table[:, [3, 4, 5, 1, 2]], rows

    @property
    def file_names(self) -> list[str]:
        return list(self._file_names)

    @property
    def dtype_names(self) -> list[str]:
        return list(self._dtypes)

    @property
    def shape_list(self) -> list[tuple[int, ...]]:
        return list(self._shapes)

    def source_keys(self) -> list[str]:
        """Every expert's source key (``provenance``), in row order; computed once, from the
        range columns (no entries built)."""
        if self._source_keys is None:
            names, ptr = self._file_names, self._r_ptr_list
            ranges = [ByteRange(names[f], s, e) for f, s, e in self._r_table.tolist()]
            self._source_keys = [source_key(ranges[ptr[i]:ptr[i + 1]], self.files)
                                 for i in range(self.n_experts)]
        return self._source_keys

    def digest_hex(self, row: int) -> str:
        return self.digests[row].tobytes().hex()

    # -- digests learnt from proven bytes (a manifest made from headers) -------------------
    def unlearnt(self, row: int) -> bool:
        """Whether the expert at ``row`` has no digest yet: its placeholder must never verify."""
        return self._learnt is not None and not self._learnt[row]

    def learn(self, row: int, digest: bytes) -> None:
        """The expert at ``row`` has ``digest`` (xxh3-128 of its bytes, proven against the Hub's
        hash of its file by whoever calls this)."""
        if self._learnt is None:
            raise errors.Internal(f"{self.key}: its digests are its maker's, not learnt")
        self.digests[row] = np.frombuffer(digest, dtype=np.uint8)
        self._learnt[row] = True
        self._cache.pop(row, None)

    # -- persistence -----------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        meta = np.frombuffer(json.dumps(self._meta, separators=(",", ":")).encode(), np.uint8)
        np.savez_compressed(buf, meta=meta, **self._arrays)  # type: ignore[arg-type]
        return buf.getvalue()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically and durably: a temp file in the same directory, synced, renamed, and
        the directory synced (``cachecd.durable``: F_FULLFSYNC on macOS, fsync elsewhere)."""
        write_atomic(Path(path), self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Manifest:
        return cls.from_bytes(read_manifest_file(Path(path)), source=str(path))

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "<bytes>") -> Manifest:
        meta, arrays = read_archive(data, source)
        return cls(check_archive(meta, arrays, source), source)

    @classmethod
    def from_parts(
        cls, meta: dict[str, Any], arrays: dict[str, np.ndarray], source: str = "<memory>"
    ) -> Manifest:
        """A manifest from its meta and columns (what the builder assembles); validated."""
        meta = json.loads(json.dumps(meta))  # the same plain-JSON form a load gives
        return cls(check_archive(meta, dict(arrays), source), source)

    @classmethod
    def from_entries(
        cls,
        *,
        repo: str,
        revision: str,
        model_type: str,
        quant_format: str,
        config_sha256: str,
        files: Iterable[FileInfo],
        experts: Iterable[ExpertEntry],
        resident: Iterable[TensorInfo],
        experts_per_layer: int | None = None,
        made: str | None = None,
    ) -> Manifest:
        """A validated manifest from objects (the builder, tests and benches use this)."""
        experts = list(experts)
        if experts_per_layer is None:
            per_layer: dict[int, int] = {}
            for e in experts:
                per_layer[e.layer] = per_layer.get(e.layer, 0) + 1
            experts_per_layer = max(per_layer.values(), default=0)
        meta = build_meta(
            repo=repo,
            revision=revision,
            model_type=model_type,
            quant_format=quant_format,
            config_sha256=config_sha256,
            files=files,
            experts_per_layer=experts_per_layer,
            resident=resident,
            made=made,
        )
        arrays = encode_experts(meta, experts)
        return cls.from_parts(meta, arrays)


def read_archive(data: bytes, source: str) -> tuple[Any, dict[str, np.ndarray]]:
    """The raw meta and arrays of a manifest file; only the container is checked here."""
    if not data.startswith(b"PK\x03\x04"):  # np.load would try .npy and pickle otherwise
        raise errors.ManifestInvalid(f"{source}: not a cachecd manifest (not a zip archive)")
    bounds.check_archive_sizes(data, source)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as exc:  # numpy raises zipfile, ValueError, OSError, EOFError...
        raise errors.ManifestInvalid(
            f"{source}: not a cachecd manifest archive ({type(exc).__name__}: {exc})"
        ) from exc
    raw = arrays.pop("meta", None)
    if raw is None or raw.dtype != np.uint8 or raw.ndim != 1:
        raise errors.ManifestInvalid(f"{source}: meta: missing or not a byte array")
    return bounds.loads(raw.tobytes(), source, "meta"), arrays


def read_manifest_file(path: Path) -> bytes:
    """A manifest file's bytes, refused unread past ``bounds.MAX_ARCHIVE_BYTES``."""
    try:
        with open(path, "rb") as f:
            data = f.read(bounds.MAX_ARCHIVE_BYTES + 1)
    except OSError as exc:
        raise errors.ManifestInvalid(f"{path}: cannot read the manifest ({exc})") from exc
    if len(data) > bounds.MAX_ARCHIVE_BYTES:
        raise errors.ManifestInvalid(
            f"{path}: over the {bounds.MAX_ARCHIVE_BYTES}-byte manifest limit")
    return data


def manifest_filename(repo: str) -> str:
    """``org/name`` -> ``org--name.manifest``, the name shipped manifests use."""
    return repo.replace("/", "--") + MANIFEST_SUFFIX


def shipped_manifest(repo: str) -> Path | None:
    """The manifest shipped for ``repo`` in the cachecd_manifests package, if any."""
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", repo) or ".." in repo:
        return None
    res = resources.files("cachecd_manifests").joinpath(manifest_filename(repo))
    if not res.is_file():
        return None
    return Path(str(res))
