"""``/metrics`` in the Prometheus text format, from the daemon's counters and store stats."""

from __future__ import annotations

import re
from typing import Any

_NAME = re.compile(r"[^a-zA-Z0-9_]")


def _flatten(prefix: str, value: Any, out: list[tuple[str, float]]) -> None:
    if isinstance(value, bool):
        out.append((prefix, float(value)))
    elif isinstance(value, (int, float)):
        out.append((prefix, float(value)))
    elif isinstance(value, dict):
        for key, sub in value.items():
            _flatten(f"{prefix}_{_NAME.sub('_', str(key))}", sub, out)


def render_metrics(daemon: Any) -> str:
    status = daemon.status()
    samples: list[tuple[str, float]] = []
    for section in ("store", "counters", "upstream", "scrub"):
        _flatten(f"cachecd_{section}", status.get(section, {}), samples)
    samples.append(("cachecd_inflight_fetches", float(status["inflight"])))
    samples.append(("cachecd_uptime_seconds", float(status["uptime_s"])))
    samples.append(("cachecd_models_registered", float(len(status["models"]))))
    lines = []
    for name, value in samples:
        lines.append(f"# TYPE {name} gauge")
        lines.append(f"{name} {value:g}")
    return "\n".join(lines) + "\n"
