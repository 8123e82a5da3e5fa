"""The cache's view of one request to ``cachecd openai``: the experts the engine read, from where,
and how many the daemon fetched from the Hub for them.

Attribution: one model runs on mlx-lm's one generation thread, and its server batches the
requests in flight into the same forward passes, so an expert read for a batched step serves all
of them at once. A request's figures are the change of the engine's counters between its arrival
and its answer; ``other_requests`` is how many other requests were in flight at some point in that
window: 0 means the figures are this request's alone, more means they include the others' reads
(no share is guessed).

The prompt: ``prompt_tokens_cached`` of the request's prompt tokens came from mlx-lm's prompt cache
(its KV caches of earlier requests: a chat's earlier turns), and only the other
``prompt_tokens_prefilled`` went through the model, so only their experts were read.
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
    "experts_routed": "experts_routed",  # distinct experts of each layer call, summed
    "expert_rows": "rows",  # (token, expert) pairs the layer calls computed
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

    def view(self, window: Window, prompt_tokens: int | None = None,
             cached_tokens: int | None = None) -> dict[str, float | int]:
        """The figures from the window's start to now; with the prompt's token count and how
        many of them the prompt cache held (mlx-lm's counts), the split of the prompt too."""
        now = self._counters()
        out: dict[str, float | int] = {
            name: now[key] - window.start[key] for name, key in FIELDS.items()}
        out["expert_wait_s"] = round(float(out["expert_wait_s"]), 4)
        # Read through the daemon: on demand, and ahead (used or not).
        out["experts_read"] = now["source_hits"] + now["staged"] - (
            window.start["source_hits"] + window.start["staged"])
        if prompt_tokens is not None:
            cached = max(0, cached_tokens or 0)
            out["prompt_tokens_cached"] = cached
            out["prompt_tokens_prefilled"] = prompt_tokens - cached
        out["other_requests"] = window.others
        return out

    def close(self, window: Window) -> None:
        with self._lock:
            self._open.discard(window)
