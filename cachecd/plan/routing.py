"""The layer calls a workload makes, in order: a recorded trace's, or the model's flat routing.

A ``Workload`` is a list of calls ``(layer, experts, decode)``: the distinct experts one MoE
layer call routes to, and whether the call is one decode token (one row). Hit rates are counted
over decode calls, the calls a token's speed is made of; prefill calls still pass through the
caches, as they do in the engine.

Flat routing: every decode token routes to ``top_k`` distinct experts per MoE layer, uniformly
at random (seeded). K3's router is built to be flat (DESIGN.md), so without a trace this is the
honest default; any cache then hits in proportion to the share of experts it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cachecd import constants
from cachecd.errors import InvalidRequest
from cachecd.manifest.manifest import Manifest

Call = tuple[int, list[int], bool]  # layer, distinct experts, a decode call (one token)
# Top-k of model types whose manifests do not say it (the config does); --top-k overrides.
TOP_K = {"kimi_k3": constants.K3_EXPERTS_PER_TOKEN, "kimi_k2": 8, "deepseek_v3": 8}


@dataclass
class Workload:
    calls: list[Call]
    tokens: int  # decode tokens
    source: str  # what the calls came from, in words
    top_k: int

    def __len__(self) -> int:
        return len(self.calls)


def flat(manifest: Manifest, top_k: int, tokens: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    e = manifest.experts_per_layer
    if not 1 <= top_k <= e:
        raise InvalidRequest(f"--top-k {top_k}: must be in 1..{e} (experts per layer)")
    calls: list[Call] = []
    for _ in range(tokens):
        for layer in manifest.moe_layers:
            calls.append((layer, rng.choice(e, top_k, replace=False).tolist(), True))
    return Workload(calls, tokens, f"flat routing, top-{top_k}, {tokens} tokens", top_k)


def from_traces(manifest: Manifest, paths: Sequence[str]) -> Workload:
    from cachecd_engine.trace import read_calls, read_traces

    trace = read_traces(paths)  # checks each file and that they are of one model
    if trace.model not in (None, manifest.repo):
        raise InvalidRequest(f"{', '.join(paths)}: traces of {trace.model}, not {manifest.repo}")
    layers, e = set(manifest.moe_layers), manifest.experts_per_layer
    calls: list[Call] = []
    top_k = 0
    for path in paths:
        for layer, rows in read_calls(path):
            if layer not in layers or rows.size and (rows.min() < 0 or rows.max() >= e):
                raise InvalidRequest(f"{path}: layer {layer} experts {rows.min()}-{rows.max()} "
                                     f"are not experts of {manifest.key}")
            top_k = max(top_k, rows.shape[1])
            calls.append((layer, list(dict.fromkeys(rows.reshape(-1).tolist())),
                          rows.shape[0] == 1))
    tokens = _decode_tokens(calls)
    if not tokens:
        raise InvalidRequest(f"{', '.join(paths)}: no decode step (one token a call) to project "
                             "from; record a generation with cachecd run --trace FILE")
    return Workload(calls, tokens, f"{len(paths)} trace(s), {tokens} decode tokens", top_k)


def _decode_tokens(calls: list[Call]) -> int:
    """Decode tokens: runs of decode calls, a new token each time the layer goes back."""
    tokens, last = 0, None
    for layer, _, decode in calls:
        if decode and (last is None or layer <= last):
            tokens += 1
        last = layer if decode else None
    return tokens
