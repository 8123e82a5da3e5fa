"""A running daemon's round trip for one expert on the data path (the request a layer call
with misses makes), when a daemon answers and serves a model with an expert cached.

The requests are marked as warming, so the daemon counts no use, hit or miss for them: the
doctor leaves the cache's statistics as they were. Nothing is fetched: only an expert the
daemon reports cached is asked for.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

REQUESTS = 20


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


def _cached_expert(client: Any, model: dict[str, Any]) -> tuple[int, int, int] | None:
    """(layer, expert, bytes) of the smallest cached expert of ``model``, if any."""
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
    return int(manifest.layer_ids[row]), int(manifest.expert_ids[row]), int(manifest.sizes[row])


def _time(client: Any, repo: str, layer: int, expert: int, nbytes: int) -> dict[str, Any]:
    times = []
    for _ in range(REQUESTS + 2):
        t0 = time.perf_counter()
        client.experts(repo, layer, [expert])
        times.append(time.perf_counter() - t0)
    return {"socket": str(client.socket), "model": repo, "expert_bytes": nbytes,
            "request_s": statistics.median(times[2:])}
