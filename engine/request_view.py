"""The cache's view of one request to ``cachecd openai``: the experts the engine read, from where,
and how many the daemon fetched from the Hub for them.

Attribution: one model runs on mlx-lm's one generation thread, and its server batches the
requests in flight into the same forward passes, so an expert read for a batched step serves all
of them at once. A request's figures are the change of the engine's counters between its arrival
and its answer; ``other_requests`` is how many other requests were in flight at some point in that
window: 0 means the figures are this request's alone, more means they include the others' reads
(no share is guessed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

# Reported name -> counter (EngineStats fields, and "fetched": the client's upstream_fetches).
FIELDS = {
    "experts_fetched": "fetched",  # read through the daemon after it fetched them from the Hub
    "experts_from_daemon": "source_hits",  # read through the daemon when the call needed them
    "experts_read_ahead": "staged_hits",  # already read ahead into a slot
    "experts_from_ram": "ram_hits",  # already in a slot of the engine's pool
    "bytes_from_daemon": "source_bytes",  # demand and read-ahead reads
    "expert_wait_s": "wait_s",  # time the model waited for experts
}


@dataclass(eq=False)
class Window:
    start: dict[str, float]
    others: int = 0


class RequestViews:
    """Opens a window per request over ``counters`` (cumulative, never reset while serving)."""

    def __init__(self, counters: Callable[[], dict[str, float]]) -> None:
        self._counters = counters
        self._lock = threading.Lock()
        self._open: set[Window] = set()

    def open(self) -> Window:
        with self._lock:
            window = Window(self._counters(), others=len(self._open))
            for other in self._open:
                other.others += 1
            self._open.add(window)
        return window

    def view(self, window: Window) -> dict[str, float | int]:
        """The figures from the window's start to now."""
        now = self._counters()
        out: dict[str, float | int] = {
            name: now[key] - window.start[key] for name, key in FIELDS.items()}
        out["expert_wait_s"] = round(float(out["expert_wait_s"]), 4)
        out["other_requests"] = window.others
        return out

    def close(self, window: Window) -> None:
        with self._lock:
            self._open.discard(window)
