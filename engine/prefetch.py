"""Next-layer prefetch hints: guess layer L+1's experts from layer L's MoE input.

The hidden state changes little from one layer to the next, so layer L+1's router applied to
layer L's MoE input picks most of the experts L+1 will route to. The guess is sent to the source
as a fire-and-forget hint (the daemon starts fetching misses while layer L computes).

Invariants:
- A hint never changes a token: the guess is computed beside the model, never fed into it, and
  the real routing of L+1 is still read back and served in full.
- No extra sync: the guess is evaluated together with layer L's routing read-back.
- Experts already in the RAM tier are not hinted; an empty hint is not sent.
- The model's parameter tree is unchanged (the MoE modules change class, not contents).
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from cachecd import errors
from cachecd_engine.streamed_moe import ExpertBank, StreamedSwitchGLU

log = logging.getLogger(__name__)


class Prefetcher:
    """Holds each MoE layer's pending guess for the next MoE layer until its read-back."""

    def __init__(self, bank: ExpertBank, next_gates: dict[int, tuple[int, nn.Module]]) -> None:
        self.bank = bank
        self.next_gates = next_gates  # layer -> (next MoE layer, its SparseMoE module)
        self._pending: dict[int, mx.array] = {}
        self.hinted = 0  # experts hinted since construction
        self.hints = 0  # hint calls

    def guess(self, layer: int, x: mx.array) -> None:
        """Record a lazy guess of the next MoE layer's experts from this layer's MoE input."""
        nxt = self.next_gates.get(layer)
        if nxt is None:
            return
        _, moe = nxt
        scores = mx.sigmoid(moe.gate(x).astype(mx.float32)) + moe.e_score_correction_bias
        k = moe.args.num_experts_per_token
        self._pending[layer] = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]

    def take(self, layer: int) -> mx.array | None:
        return self._pending.pop(layer, None)

    def send(self, layer: int, guess: np.ndarray) -> None:
        next_layer, _ = self.next_gates[layer]
        ids = [e for e in np.unique(guess).tolist() if (next_layer, e) not in self.bank.ram]
        if not ids:
            return
        self.hints += 1
        self.hinted += len(ids)
        try:
            self.bank.source.prefetch(next_layer, ids)
        except (errors.CachecdError, OSError, RuntimeError) as exc:  # never break a token
            log.debug("prefetch hint failed layer=%d err=%s", next_layer, exc)


def _prefetching_class(base: type) -> type:
    class PrefetchingMoE(base):  # type: ignore[misc, valid-type]
        def __call__(self, x: mx.array) -> mx.array:
            glu = self.switch_mlp
            if isinstance(glu, StreamedSwitchGLU) and glu.prefetcher is not None:
                glu.prefetcher.guess(glu.layer, x)
            return super().__call__(x)

    PrefetchingMoE.__name__ = f"Prefetching{base.__name__}"
    return PrefetchingMoE


def install_prefetch(model: Any, bank: ExpertBank) -> Prefetcher:
    """Make each streamed MoE layer hint the next MoE layer's likely experts."""
    moes = [
        (i, layer.mlp)
        for i, layer in enumerate(model.layers)
        if isinstance(getattr(layer.mlp, "switch_mlp", None), StreamedSwitchGLU)
    ]
    next_gates = {moes[j][0]: moes[j + 1] for j in range(len(moes) - 1)}
    prefetcher = Prefetcher(bank, next_gates)
    classes: dict[type, type] = {}
    for _, moe in moes:
        base = type(moe)
        if base.__name__.startswith("Prefetching"):
            continue
        moe.__class__ = classes.setdefault(base, _prefetching_class(base))
        object.__setattr__(moe.switch_mlp, "prefetcher", prefetcher)
    return prefetcher
