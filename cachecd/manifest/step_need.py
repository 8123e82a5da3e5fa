"""How many bytes of experts one prefill step needs on disk at once: the smallest working budget.

The engine asks the daemon for one layer's routed experts of a step in one request, and the
daemon holds every expert of a request from its look-up until its fds are open (``Store.hold``):
a budget smaller than the largest such set can never serve that request, however often it is
retried. A step of S tokens with top-k routing reaches at most ``min(E, S * k)`` distinct experts
of a layer of E; at mlx-lm's default step (2,048 tokens) that is every expert of a layer for any
MoE model (K3: 2,048 x 16 >> 896, about 15.7 GB a layer). Without a known k, every expert of a
layer is counted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cachecd.manifest.manifest import Manifest
from cachecd.sizes import format_size

DEFAULT_PREFILL_STEP = 2048  # mlx-lm's prefill_step_size, and `cachecd run`'s default
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token")


@dataclass(frozen=True)
class StepNeed:
    nbytes: int  # the most bytes one layer's step needs at once
    layer: int  # the layer that needs them
    experts: int  # how many experts that is
    step: int
    top_k: int | None

    def routes(self) -> str:
        k = f"top-{self.top_k} routing" if self.top_k else "routing (its top-k is not known)"
        return f"a prefill step of {self.step} tokens with {k} reaches {self.experts} experts"


def top_k_of(config: dict[str, Any]) -> int | None:
    """Experts a token routes to, from a config.json (its text_config for a multimodal one)."""
    for part in (config, config.get("text_config") or {}):
        for key in _TOP_K_KEYS:
            value = part.get(key) if isinstance(part, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def top_k_in(local_dir: Path | None) -> int | None:
    """``top_k_of`` the config.json setup installed in ``local_dir`` (None when unreadable)."""
    if local_dir is None:
        return None
    try:
        return top_k_of(json.loads((Path(local_dir) / "config.json").read_text()))
    except (OSError, ValueError, AttributeError):
        return None


def step_need(manifest: Manifest, top_k: int | None, step: int = DEFAULT_PREFILL_STEP,
              served: np.ndarray | None = None) -> StepNeed:
    """The largest bytes one layer's step of ``step`` tokens can need (its largest experts);
    ``served``: per manifest row, whether this daemon serves it (a pipeline rank's layers)."""
    per_layer = manifest.experts_per_layer
    n = per_layer if top_k is None else min(per_layer, step * top_k)
    sizes = manifest.sizes.astype(np.int64).reshape(len(manifest.moe_layers), per_layer)
    if served is not None:
        sizes = np.where(served.reshape(sizes.shape), sizes, 0)
    top = -np.sort(-sizes, axis=1)[:, :n].sum(axis=1)
    worst = int(np.argmax(top))
    return StepNeed(int(top[worst]), manifest.moe_layers[worst], n, step, top_k)


def flag_size(nbytes: int) -> str:
    """A size for --budget that is at least ``nbytes`` and reads back with ``parse_size``."""
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if nbytes >= 1024 ** power:
            return f"{math.ceil(nbytes * 10 / 1024 ** power) / 10:g}{unit}"
    return str(nbytes)


def too_small(budget: int, need: StepNeed, model: str) -> str:
    """Why ``budget`` cannot run ``model``, and the smallest one that can."""
    return (f"a budget of {format_size(budget)} is too small for {model}: {need.routes()} of "
            f"layer {need.layer} ({format_size(need.nbytes)}), and they must all be on disk "
            f"at once; the smallest working budget is {flag_size(need.nbytes)}: pass --budget "
            f"{flag_size(need.nbytes)} or more (or 0: no budget beyond the free space)")


def request_too_big(model: str, experts: int, layer: int, need: int, budget: int) -> str:
    """Why one request can never be served within ``budget``, and the two fixes."""
    return (f"{model}: this request needs {experts} experts of layer {layer} on disk at once "
            f"({format_size(need)}), more than the whole budget of {format_size(budget)}: "
            f"retrying does not help; restart the daemon with --budget {flag_size(need)} or "
            "more (cachecd stop; cachecd serve --budget ...), or lower --prefill-step-size of "
            "cachecd run, warm or openai (a shorter step routes to fewer experts a layer)")
