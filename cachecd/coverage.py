"""Coverage: what of a model is local, what is missing, and what the workload would see.

Computed from the manifest's numpy columns and the store's in-memory set of digests, so a
K3-sized model (82,432 experts) is one vectorised pass, not a query per expert.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from cachecd.manifest import Manifest


def cached_mask(manifest: Manifest, has: Callable[[str], bool]) -> np.ndarray:
    hexes = manifest.digests.tobytes().hex()
    return np.fromiter((has(hexes[i * 32:(i + 1) * 32]) for i in range(manifest.n_experts)),
                       dtype=bool, count=manifest.n_experts)


def access_array(manifest: Manifest, counts: Mapping[tuple[int, int], Any]) -> np.ndarray:
    """Per-row access counts (rows as in the manifest) from {(layer, expert): (count, last)}."""
    out = np.zeros(manifest.n_experts, dtype=np.int64)
    for (layer, expert), value in counts.items():
        try:
            row = manifest.row(layer, expert)
        except Exception:  # stats for an expert this revision does not have
            continue
        out[row] = value[0] if isinstance(value, (tuple, list)) else int(value)
    return out


def coverage_report(manifest: Manifest, cached: np.ndarray, access: np.ndarray) -> dict[str, Any]:
    sizes = manifest.sizes
    layers = []
    for layer in manifest.moe_layers:
        rows = manifest.layer_ids == layer
        layers.append({
            "layer": int(layer),
            "experts_total": int(rows.sum()),
            "experts_cached": int((cached & rows).sum()),
            "bytes_total": int(sizes[rows].sum()),
            "bytes_cached": int(sizes[cached & rows].sum()),
            "accesses": int(access[rows].sum()),
        })
    total_access = int(access.sum())
    weighted = float(access[cached].sum() / total_access) if total_access else None
    return {
        "repo": manifest.repo,
        "revision": manifest.revision,
        "experts_total": int(manifest.n_experts),
        "experts_cached": int(cached.sum()),
        "bytes_total": int(sizes.sum()),
        "bytes_cached": int(sizes[cached].sum()),
        "resident_bytes": int(manifest.resident_bytes_total),
        "accesses": total_access,
        "workload_coverage": weighted,
        "layers": layers,
    }
