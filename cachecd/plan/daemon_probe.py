"""A running daemon's round trip on the data path (the request a layer call with misses
makes), for one expert and for several of one layer, when a daemon answers and serves a model
with experts cached: a fixed cost per request and a cost per expert beyond its bytes.

The requests are marked as warming, so the daemon counts no use, hit or miss for them: the
doctor leaves the cache's statistics as they were. Nothing is fetched: only an expert the
daemon reports cached is asked for.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

REQUESTS = 20
MANY = 8  # experts of one layer in the second request


def probe_daemon(socket: str | None = None) -> dict[str, Any] | None:
    from cachecd.errors import CachecdError
    from cachecd_client import Client

    try:
        with Client(socket, timeout=10) as client:
            client.warming = True
            for model in client.models():
                found = _cached_expert(client, model)
                if found is not None:
                    return _time(client, model["repo"], *found)
    except (CachecdError, OSError):
        return None
    return None


def _cached_expert(client: Any, model: dict[str, Any]) -> tuple[int, list[int], int] | None:
    """(layer, experts, bytes of one) of up to ``MANY`` cached experts of the layer holding the
    smallest cached expert of ``model``, if any."""
    import numpy as np

    from cachecd.manifest.manifest import Manifest
    from cachecd.report.coverage import unpack_detail

    repo = model["repo"]
    cached, _ = unpack_detail(client.coverage(repo, detail=True)["detail"])
    if not cached.any():
        return None
    manifest = Manifest.from_bytes(client.manifest_bytes(repo), f"daemon:{repo}")
    rows = np.flatnonzero(cached)
    row = int(rows[np.argmin(manifest.sizes[rows])])
    layer = int(manifest.layer_ids[row])
    same = rows[(manifest.layer_ids[rows] == layer) & (manifest.sizes[rows] == manifest.sizes[row])]
    return layer, [int(e) for e in manifest.expert_ids[same][:MANY]], int(manifest.sizes[row])


def _time(client: Any, repo: str, layer: int, experts: list[int], nbytes: int) -> dict[str, Any]:
    def median_s(ids: list[int]) -> float:
        times = []
        for _ in range(REQUESTS + 2):
            t0 = time.perf_counter()
            client.experts(repo, layer, ids)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[2:])

    one = median_s(experts[:1])
    many = median_s(experts) if len(experts) > 1 else one
    per = max(0.0, (many - one) / (len(experts) - 1)) if len(experts) > 1 else 0.0
    return {"socket": str(client.socket), "model": repo, "expert_bytes": nbytes,
            "request_s": one, "experts": len(experts), "per_expert_s": per}
