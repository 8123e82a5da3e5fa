"""Parse a safetensors header from bytes (no file, no network: the caller fetches the bytes).

Layout: 8 bytes little-endian u64 N, then N bytes of JSON mapping tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (relative to the data section at 8 + N),
plus an optional ``__metadata__``. Invariant enforced here: the tensors tile the data section
exactly (sorted by begin, no gap, no overlap), as the safetensors format requires, so every
data byte belongs to exactly one tensor.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from cachecd import errors
from cachecd.manifest import bounds

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int  # absolute, exclusive

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def header_length(first8: bytes, source: str = "<file>") -> int:
    """N from the first 8 bytes; raises ManifestInvalid when implausible."""
    if len(first8) < 8:
        raise errors.ManifestInvalid(f"{source}: shorter than a safetensors header (8 bytes)")
    (n,) = struct.unpack("<Q", first8[:8])
    if n < 2 or n > MAX_HEADER_BYTES:
        raise errors.ManifestInvalid(f"{source}: safetensors header length {n} is implausible")
    return int(n)


def parse_header(
    data: bytes, file_size: int | None = None, source: str = "<file>"
) -> tuple[int, list[HeaderTensor]]:
    """(N, tensors sorted by offset) from at least the first 8 + N bytes of a safetensors file."""
    n = header_length(data, source)
    if len(data) < 8 + n:
        raise errors.ManifestInvalid(f"{source}: header needs {8 + n} bytes, got {len(data)}")
    raw = bounds.loads(data[8 : 8 + n], source, "safetensors header", MAX_HEADER_BYTES)
    if not isinstance(raw, dict):
        raise errors.ManifestInvalid(f"{source}: safetensors header is not a JSON object")
    tensors = [
        _tensor(name, spec, 8 + n, source) for name, spec in raw.items() if name != "__metadata__"
    ]
    tensors.sort(key=lambda t: (t.start, t.end))
    pos = 8 + n
    for t in tensors:
        if t.start != pos:
            raise errors.ManifestInvalid(
                f"{source}: tensor {t.name} starts at {t.start}, expected {pos} (gap or overlap)"
            )
        pos = t.end
    if file_size is not None and pos != file_size:
        raise errors.ManifestInvalid(
            f"{source}: tensors end at {pos} but the file has {file_size} bytes"
        )
    return n, tensors


def _tensor(name: str, spec: object, data_start: int, source: str) -> HeaderTensor:
    ok = (
        isinstance(spec, dict)
        and isinstance(spec.get("dtype"), str)
        and isinstance(spec.get("shape"), list)
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in spec["shape"])
        and isinstance(spec.get("data_offsets"), list)
        and len(spec["data_offsets"]) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in spec["data_offsets"])
    )
    if not ok:
        raise errors.ManifestInvalid(f"{source}: tensor {name!r:.200}: malformed header entry")
    assert isinstance(spec, dict)
    begin, end = spec["data_offsets"]
    if not 0 <= begin <= end:
        raise errors.ManifestInvalid(
            f"{source}: tensor {name}: data_offsets {begin}..{end} reversed"
        )
    return HeaderTensor(
        name, spec["dtype"], tuple(spec["shape"]), data_start + begin, data_start + end
    )


@dataclass(frozen=True)
class HeaderColumns:
    """A header as columns, sorted by offset (what checking a K3-sized manifest needs: 96
    headers of ~5,000 tensors each would take seconds as ``HeaderTensor`` objects)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    starts: np.ndarray  # int64, absolute
    ends: np.ndarray  # int64, absolute, exclusive


def parse_header_columns(data: bytes, file_size: int, source: str = "<file>"
                         ) -> tuple[int, HeaderColumns]:
    """``parse_header``'s checks (the tensors tile the data section up to ``file_size``), as
    columns."""
    n = header_length(data, source)
    if len(data) < 8 + n:
        raise errors.ManifestInvalid(f"{source}: header needs {8 + n} bytes, got {len(data)}")
    raw = bounds.loads(data[8 : 8 + n], source, "safetensors header", MAX_HEADER_BYTES)
    try:
        raw.pop("__metadata__", None)
        names, specs = list(raw), list(raw.values())
        dtypes = [sp["dtype"] for sp in specs]
        shapes = [tuple(sp["shape"]) for sp in specs]
        pairs = [sp["data_offsets"] for sp in specs]
        ok = (all(type(d) is str for d in dtypes)
              and all(type(x) is int and x >= 0 for sh in set(shapes) for x in sh)
              and all(type(pr) is list and len(pr) == 2 for pr in pairs)
              and all(type(x) is int for pr in pairs for x in pr))
        offsets = np.array(pairs or np.zeros((0, 2)), np.int64)
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError,
            OverflowError) as exc:
        raise errors.ManifestInvalid(f"{source}: malformed safetensors header ({exc!r:.200})") from exc
    if not ok:
        raise errors.ManifestInvalid(f"{source}: malformed safetensors header entries")
    order = np.lexsort((offsets[:, 1], offsets[:, 0]))
    starts, ends = offsets[order, 0] + 8 + n, offsets[order, 1] + 8 + n
    want = np.concatenate([[8 + n], ends[:-1]]) if len(ends) else np.zeros(0, np.int64)
    bad = np.flatnonzero((starts != want) | (ends < starts))
    if bad.size:
        i = int(order[bad[0]])
        raise errors.ManifestInvalid(f"{source}: tensor {names[i]} starts at {starts[bad[0]]}, "
                                     f"expected {want[bad[0]]} (gap or overlap)")
    end = int(ends[-1]) if len(ends) else 8 + n
    if end != file_size:
        raise errors.ManifestInvalid(
            f"{source}: tensors end at {end} but the file has {file_size} bytes")
    pick = order.tolist()
    return n, HeaderColumns([names[i] for i in pick], [dtypes[i] for i in pick],
                            [shapes[i] for i in pick], starts, ends)
