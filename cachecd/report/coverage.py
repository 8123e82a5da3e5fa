"""Coverage: what of a model is local, what is missing, and what the workload would see.

Computed from the manifest's numpy columns and the store's in-memory set of digests, so a
K3-sized model (82,432 experts) is a few vectorised passes, not a query per expert.

Invariants:
- Every per-expert array here is indexed by manifest row (rows sorted by (layer, expert), each
  MoE layer holding experts 0..experts_per_layer-1), so row = layer position * E + expert.
- "Workload coverage" is the hit rate a recorded workload would see now: the share of its
  expert accesses that land on cached experts. Accesses are whatever the caller passes (the
  daemon's per-expert counts, or a routing trace's), never a guess.
- The plan to reach a target hit rate is greedy by accesses per byte: for equal-sized experts
  (every supported model) that is the optimum for "fewest bytes to reach X%".
- A registration restricted to some layers (a pipeline rank's) is reported over those layers
  only: totals, per-layer rows, most wanted and the plan all leave the other layers out.
- The hit/miss history is in memory, per model, in fixed time buckets; a restart starts it
  afresh (the per-expert access counts, which coverage uses, are durable in the index).
"""

from __future__ import annotations

import base64
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from cachecd.manifest.manifest import Manifest

TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
MOST_WANTED = 20
HISTORY_BUCKET_S = 60
HISTORY_BUCKETS = 24 * 60  # one day of minutes


# ---- per-expert arrays --------------------------------------------------------------------


def cached_mask(manifest: Manifest, has: Callable[[str, str], bool]) -> np.ndarray:
    """Which experts are hits: ``has(digest, source key)`` (``Store.has_source``), so a blob
    cached for another expert with the same digest does not count (``manifest.provenance``)."""
    hexes, keys = manifest.digests.tobytes().hex(), manifest.source_keys()
    return np.fromiter((has(hexes[i * 32:(i + 1) * 32], keys[i])
                        for i in range(manifest.n_experts)),
                       dtype=bool, count=manifest.n_experts)


def pinned_mask(manifest: Manifest, pins: set[str]) -> np.ndarray:
    """Which experts' blobs are pinned (``Store.pins``: digests, kept through any eviction)."""
    if not pins:
        return np.zeros(manifest.n_experts, dtype=bool)
    hexes = manifest.digests.tobytes().hex()
    return np.fromiter((hexes[i * 32:(i + 1) * 32] in pins for i in range(manifest.n_experts)),
                       dtype=bool, count=manifest.n_experts)


def served_mask(manifest: Manifest, layers: tuple[int, int] | None) -> np.ndarray:
    """Per row: whether its layer is in ``[start, end)`` (every row when ``layers`` is None)."""
    lids = manifest.layer_ids
    if layers is None:
        return np.ones(len(lids), dtype=bool)
    return (lids >= layers[0]) & (lids < layers[1])


def rows_of(manifest: Manifest, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """Manifest rows of (layer, expert) pairs; -1 where the revision has no such expert."""
    moe = np.asarray(manifest.moe_layers, dtype=np.int64)
    layers, experts = np.asarray(layers, np.int64), np.asarray(experts, np.int64)
    pos = np.clip(np.searchsorted(moe, layers), 0, max(len(moe) - 1, 0))
    ok = (moe[pos] == layers) & (experts >= 0) & (experts < manifest.experts_per_layer)
    return np.where(ok, pos * manifest.experts_per_layer + experts, -1)


def access_array(manifest: Manifest, counts: Mapping[tuple[int, int], Any]) -> np.ndarray:
    """Per-row access counts from {(layer, expert): (count, last)} or {(layer, expert): count}.

    Counts for experts this revision does not have (stats of an older revision) are dropped.
    """
    out = np.zeros(manifest.n_experts, dtype=np.int64)
    if not counts:
        return out
    keys = np.array(list(counts.keys()), dtype=np.int64).reshape(-1, 2)
    values = np.fromiter((v[0] if isinstance(v, (tuple, list)) else v for v in counts.values()),
                         dtype=np.int64, count=len(counts))
    rows = rows_of(manifest, keys[:, 0], keys[:, 1])
    keep = rows >= 0
    np.add.at(out, rows[keep], values[keep])
    return out


def pack_detail(cached: np.ndarray, access: np.ndarray) -> dict[str, Any]:
    """Per-row arrays in a compact wire form: packed bits and little-endian uint64, base64."""
    return {
        "rows": int(cached.size),
        "cached": base64.b64encode(np.packbits(cached.astype(bool)).tobytes()).decode(),
        "access": base64.b64encode(access.astype("<u8").tobytes()).decode(),
    }


def unpack_detail(detail: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    n = int(detail["rows"])
    bits = np.frombuffer(base64.b64decode(detail["cached"]), dtype=np.uint8)
    cached = np.unpackbits(bits, count=n).astype(bool)
    access = np.frombuffer(base64.b64decode(detail["access"]), dtype="<u8").astype(np.int64)
    if access.size != n:
        raise ValueError(f"coverage detail has {access.size} access counts for {n} experts")
    return cached, access


# ---- the report ---------------------------------------------------------------------------


def coverage_report(manifest: Manifest, cached: np.ndarray, access: np.ndarray, *,
                    layers: tuple[int, int] | None = None, targets: tuple[float, ...] = TARGETS,
                    top: int = MOST_WANTED) -> dict[str, Any]:
    """The report over every expert, or over the layers ``[start, end)`` a restricted
    registration serves."""
    sizes = manifest.sizes.astype(np.int64)
    served = served_mask(manifest, layers)
    cached = np.asarray(cached, dtype=bool) & served
    access = np.where(served, np.asarray(access, dtype=np.int64), 0)
    total_access = int(access.sum())
    hit_access = int(access[cached].sum())
    rows = _layers(manifest, cached, access, sizes)
    return {
        "repo": manifest.repo,
        "revision": manifest.revision,
        "served_layers": list(layers) if layers is not None else None,
        "experts_total": int(served.sum()),
        "experts_cached": int(cached.sum()),
        "bytes_total": int(sizes[served].sum()),
        "bytes_cached": int(sizes[cached].sum()),
        "resident_bytes": int(manifest.resident_bytes_total),
        "accesses": total_access,
        "accesses_cached": hit_access,
        "workload_coverage": hit_access / total_access if total_access else None,
        "layers": [r for r in rows if layers is None or layers[0] <= r["layer"] < layers[1]],
        "most_wanted": most_wanted(manifest, cached, access, top),
        "to_reach": bytes_to_reach(sizes, cached, access, targets),
    }


def _layers(manifest: Manifest, cached: np.ndarray, access: np.ndarray,
            sizes: np.ndarray) -> list[dict[str, Any]]:
    n_layers, per = len(manifest.moe_layers), manifest.experts_per_layer
    shape = (n_layers, per)
    c, a, s = cached.reshape(shape), access.reshape(shape), sizes.reshape(shape)
    cols = {
        "experts_cached": c.sum(axis=1),
        "bytes_total": s.sum(axis=1),
        "bytes_cached": (s * c).sum(axis=1),
        "accesses": a.sum(axis=1),
        "accesses_cached": (a * c).sum(axis=1),
    }
    lists = {k: v.tolist() for k, v in cols.items()}
    out = []
    for i, layer in enumerate(manifest.moe_layers):
        row = {"layer": int(layer), "experts_total": per, **{k: v[i] for k, v in lists.items()}}
        row["workload_coverage"] = (row["accesses_cached"] / row["accesses"]
                                    if row["accesses"] else None)
        out.append(row)
    return out


def warm_order(sizes: np.ndarray, cached: np.ndarray, access: np.ndarray) -> np.ndarray:
    """Rows of the missing experts with accesses, most accesses per byte first (stable)."""
    missing = np.flatnonzero(~np.asarray(cached, bool) & (np.asarray(access) > 0))
    density = access[missing] / np.maximum(sizes[missing], 1)
    return missing[np.argsort(-density, kind="stable")]


def most_wanted(manifest: Manifest, cached: np.ndarray, access: np.ndarray,
                top: int = MOST_WANTED) -> list[dict[str, Any]]:
    order = warm_order(manifest.sizes, cached, access)[:top]
    return [{"layer": int(manifest.layer_ids[r]), "expert": int(manifest.expert_ids[r]),
             "accesses": int(access[r]), "bytes": int(manifest.sizes[r])} for r in order]


def bytes_to_reach(sizes: np.ndarray, cached: np.ndarray, access: np.ndarray,
                   targets: tuple[float, ...] = TARGETS) -> list[dict[str, Any]]:
    """For each target hit rate: how many more bytes (and experts) of the workload reach it."""
    total = int(access.sum())
    have = int(access[cached].sum())
    order = warm_order(sizes, cached, access)
    gained = np.cumsum(access[order])
    spent = np.cumsum(sizes[order].astype(np.int64))
    out = []
    for target in targets:
        row: dict[str, Any] = {"target": target, "bytes_more": None, "experts_more": None}
        if total and have >= target * total:
            row.update(bytes_more=0, experts_more=0)
        elif total:
            k = int(np.searchsorted(gained, target * total - have))  # first index reaching it
            if k < len(order):
                row.update(bytes_more=int(spent[k]), experts_more=k + 1)
        out.append(row)
    return out


def trace_weighted(cached: np.ndarray, access: np.ndarray) -> float | None:
    total = int(access.sum())
    return int(access[cached].sum()) / total if total else None


# ---- hit/miss history ---------------------------------------------------------------------


class HitHistory:
    """Hits and misses per model in fixed time buckets (the last ``buckets`` of them)."""

    def __init__(self, bucket_s: int = HISTORY_BUCKET_S, buckets: int = HISTORY_BUCKETS,
                 clock: Callable[[], float] = time.time) -> None:
        self.bucket_s = bucket_s
        self._clock = clock
        self._max = buckets
        self._mu = threading.Lock()
        self._series: dict[str, deque[list[int]]] = {}

    def record(self, model_key: str, hits: int, misses: int) -> None:
        start = int(self._clock() // self.bucket_s) * self.bucket_s
        with self._mu:
            series = self._series.setdefault(model_key, deque(maxlen=self._max))
            if series and series[-1][0] == start:
                series[-1][1] += hits
                series[-1][2] += misses
            else:
                series.append([start, hits, misses])
            while series and series[0][0] <= start - self._max * self.bucket_s:
                series.popleft()

    def snapshot(self, model_key: str) -> dict[str, Any]:
        with self._mu:
            rows = [list(r) for r in self._series.get(model_key, ())]
        return {
            "bucket_s": self.bucket_s,
            "buckets": [{"t": t, "hits": h, "misses": m} for t, h, m in rows],
            "hits": sum(r[1] for r in rows),
            "misses": sum(r[2] for r in rows),
        }
