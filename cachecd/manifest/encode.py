"""Objects -> manifest columns: the builder's and benches' way in (``Manifest.from_entries``).

Expert tensor names are interned as templates (head, mid, tail) so that
``head + str(layer) + mid + str(expert) + tail`` gives the exact checkpoint name back; a name
whose digits are not canonical (``layers.03``) is kept literally. Nothing here validates: the
``Manifest`` built from the result does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from cachecd import constants, errors
from cachecd.manifest.entries import ExpertEntry, FileInfo, TensorInfo
from cachecd.manifest.meta import EXPERT_PATTERN, EXPERT_RE, FORMAT_NAME


def build_meta(
    *,
    repo: str,
    revision: str,
    model_type: str,
    quant_format: str,
    config_sha256: str,
    files: Iterable[FileInfo],
    experts_per_layer: int,
    resident: Iterable[TensorInfo],
    made: str | None = None,
) -> dict[str, Any]:
    """The JSON half of a manifest; ``dtypes``/``shapes``/``templates`` are filled by encoding.
    ``made`` (``meta.MADE``) says how it was made; left out when not known."""
    meta = {
        "format": FORMAT_NAME,
        "format_version": constants.MANIFEST_FORMAT_VERSION,
        "repo": repo,
        "revision": revision,
        "model_type": model_type,
        "quant_format": quant_format,
        "config_sha256": config_sha256,
        "files": [
            [f.name, f.size, f.sha256, f.header_len] for f in sorted(files, key=lambda f: f.name)
        ],
        "experts_per_layer": experts_per_layer,
        "expert_pattern": EXPERT_PATTERN,
        "dtypes": [],
        "shapes": [],
        "templates": [],
        "resident": [
            [t.name, t.dtype, list(t.shape), t.file, t.offset, t.nbytes, t.xxh3.hex()]
            for t in sorted(resident, key=lambda t: (t.file, t.offset, t.name))
        ],
    }
    if made is not None:
        meta["made"] = made
    return meta


def name_template(name: str, layer: int, expert: int) -> tuple[str, ...]:
    """(head, mid, tail) with name == head + layer + mid + expert + tail, or (name,) if the
    digits are not canonical (e.g. "layers.03"): the name must come back exactly."""
    m = EXPERT_RE.search(name)
    if m is None or (int(m.group(1)), int(m.group(2))) != (layer, expert):
        raise errors.ManifestInvalid(f"{name!r} is not a tensor of layer {layer} expert {expert}")
    if m.group(1) != str(layer) or m.group(2) != str(expert):
        return (name,)
    return (name[: m.start(1)], name[m.end(1) : m.start(2)], name[m.end(2) :])


class _Vocab:
    """Interns strings/tuples to small ints (dtypes, shapes, templates, files)."""

    def __init__(self, items: Iterable[Any] = ()) -> None:
        self.ids: dict[Any, int] = {}
        for item in items:
            self.id(item)

    def id(self, item: Any) -> int:
        return self.ids.setdefault(item, len(self.ids))

    def items(self) -> list[Any]:
        return list(self.ids)


def encode_experts(meta: dict[str, Any], experts: Iterable[ExpertEntry]) -> dict[str, np.ndarray]:
    """Column arrays for ``experts`` (any order; stored sorted by (layer, expert)); fills the
    vocabularies in ``meta``. Validation happens when the manifest is constructed."""
    rows = sorted(experts, key=lambda e: (e.layer, e.expert))
    file_ids = {f[0]: i for i, f in enumerate(meta["files"])}
    dtypes, shapes, templates = _Vocab(), _Vocab(), _Vocab()
    t_cols: dict[str, list[int]] = {
        k: [] for k in ("template", "file", "offset", "nbytes", "dtype", "shape")
    }
    t_xxh3: list[bytes] = []
    r_file: list[int] = []
    r_start: list[int] = []
    r_end: list[int] = []
    for e in rows:
        for t in e.tensors:
            t_cols["template"].append(templates.id(name_template(t.name, e.layer, e.expert)))
            t_cols["file"].append(file_ids[t.file])
            t_cols["offset"].append(t.offset)
            t_cols["nbytes"].append(t.nbytes)
            t_cols["dtype"].append(dtypes.id(t.dtype))
            t_cols["shape"].append(shapes.id(tuple(t.shape)))
            t_xxh3.append(t.xxh3)
        for r in e.ranges:
            r_file.append(file_ids[r.file])
            r_start.append(r.start)
            r_end.append(r.end)
    meta["dtypes"] = dtypes.items()
    meta["shapes"] = [list(s) for s in shapes.items()]
    meta["templates"] = [list(t) for t in templates.items()]
    return {
        "exp_layer": np.array([e.layer for e in rows], np.int32),
        "exp_expert": np.array([e.expert for e in rows], np.int32),
        "exp_nbytes": np.array([e.nbytes for e in rows], np.int64),
        "exp_xxh3": _digests([e.xxh3 for e in rows]),
        "exp_ntensors": np.array([len(e.tensors) for e in rows], np.int32),
        "exp_nranges": np.array([len(e.ranges) for e in rows], np.int32),
        **{
            f"t_{k}": np.array(v, np.int64 if k in ("offset", "nbytes") else np.int32)
            for k, v in t_cols.items()
        },
        "t_xxh3": _digests(t_xxh3),
        "r_file": np.array(r_file, np.int32),
        "r_start": np.array(r_start, np.int64),
        "r_end": np.array(r_end, np.int64),
    }


def _digests(values: list[bytes]) -> np.ndarray:
    width = {len(v) for v in values}
    if width - {16}:
        raise errors.ManifestInvalid(f"digest of {min(width - {16})} bytes, expected 16 (xxh3-128)")
    return np.frombuffer(b"".join(values), np.uint8).reshape(len(values), 16).copy()
