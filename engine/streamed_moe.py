"""The streamed ``switch_mlp``: what mlx-lm's MoE layers call instead of their expert bank.

Invariants:
- The module holds no parameters: the model's parameter tree, ``load_weights(strict=True)`` and
  ``nn.quantize`` never see expert weights; the template SwitchGLU (mlx-lm's own, quantized as
  the resident model is) sits outside the tree and gets each call's stack from the bank.
- Routing is read back once per layer, together with the next layer's guess when read-ahead is
  on, and with the queued calls that read slots of the pool (so the bank knows no queued work
  reads a slot any more); the read-back runs without the GIL, so read-ahead threads keep
  reading meanwhile.
- A call first completes the read the previous call deferred (``ExpertBank.defer_reads``):
  nothing this call queues or evaluates runs before those slots hold their experts.
- Every layer's template computes from the bank's one slot pool; the projections'
  ``sorted_indices`` is theirs to pass unless the bank clears it for a call (``dispatch``: to
  keep the resident call's kernel).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

from cachecd_engine.formats import QuantSpec
from cachecd_engine.pool.bank import ExpertBank
from cachecd_engine.pool.prefetch import Prefetcher

log = logging.getLogger(__name__)


def _flag_class(base: type) -> type:
    class Flagged(base):  # type: ignore[misc, valid-type]
        """mlx-lm's projection; the bank may clear ``sorted_indices`` to keep the kernel."""

        def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> Any:
            allow = self.__dict__.get("_allow_sorted", True)
            return super().__call__(x, indices, sorted_indices=sorted_indices and allow)

    Flagged.__name__ = f"Flagged{base.__name__}"
    return Flagged


_FLAGGED: dict[type, type] = {}


def as_template(glu: SwitchGLU, spec: QuantSpec) -> SwitchGLU:
    """Make ``glu`` compute like the resident bank of this format: quantize it as mlx-lm would,
    and let the bank choose each call's ``sorted_indices``."""
    if spec.mode is not None and isinstance(glu.gate_proj, SwitchLinear):
        # Lazy: the placeholder weights are never evaluated, each call replaces them.
        nn.quantize(glu, spec.group_size, spec.bits, mode=spec.mode)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        module = getattr(glu, proj)
        base = type(module)
        if not base.__name__.startswith("Flagged"):
            module.__class__ = _FLAGGED.setdefault(base, _flag_class(base))
    return glu


class StreamedSwitchGLU(nn.Module):
    """Called as mlx-lm calls ``switch_mlp``: ``(x, indices) -> y``. Holds no parameters."""

    def __init__(self, layer: int, template: SwitchGLU, bank: ExpertBank) -> None:
        super().__init__()
        self.layer = layer
        # Kept out of the module tree: no parameter to load, nothing for nn.quantize to touch.
        object.__setattr__(self, "_glu", template)
        object.__setattr__(self, "_bank", bank)
        bank.attach(template)
        self.prefetcher: Any = None  # set by install_prefetch

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        bank: ExpertBank = self._bank
        bank.fill.complete()  # a read the previous call deferred (its wait counted apart)
        if bank.discarding:  # an output nothing reads (prefill.py): no read-back, no read
            return mx.zeros((*indices.shape, x.shape[-1]), x.dtype)
        if bank.chunks is not None:  # a layer's prefill chunks together (pool.chunks)
            return bank.chunks.call(self.layer, self._glu, x, indices)
        if bank.speculator is not None and bank.speculator.active:
            return bank.speculator.layer_call(self.layer, self._glu, x, indices)
        guess = self.prefetcher.take(self.layer) if self.prefetcher is not None else None
        t0 = time.perf_counter()
        # The one read-back of this layer's routing (the next layer's guess and the queued
        # readers of slots with it). The eval runs without the GIL, so read-ahead threads keep
        # reading meanwhile.
        fenced = bank.fenced()
        mx.eval(indices, *fenced) if guess is None else mx.eval(indices, guess, *fenced)
        bank.synced(fenced)
        routed = np.array(indices)
        bank.stats.readback_s += time.perf_counter() - t0
        if bank.trace is not None:
            bank.trace(self.layer, routed)
        guessed = np.array(guess) if guess is not None else None
        if self.prefetcher is not None:
            self.prefetcher.score(self.layer, set(routed.ravel().tolist()))
            if guessed is not None:  # before this call claims slots: kept for the next layer
                self.prefetcher.forecast(self.layer, guessed, rows=routed.size)
        y = bank.run(self.layer, self._glu, x, routed)
        if guessed is not None:  # after this call has its buffer: the read-ahead takes the other
            self.prefetcher.send(self.layer, guessed, rows=routed.size)
        return y

    def _extra_repr(self) -> str:
        return f"layer={self.layer}, streamed"


def install_streamed_banks(model: nn.Module, bank: ExpertBank) -> list[int]:
    """Replace each MoE layer's ``mlp.switch_mlp`` with a streamed bank; return the layer ids."""
    layers = []
    for idx, layer in enumerate(model.layers):
        mlp = getattr(layer, "mlp", None)
        glu = getattr(mlp, "switch_mlp", None)
        if isinstance(glu, StreamedSwitchGLU):
            layers.append(idx)
        elif mlp is not None and isinstance(glu, SwitchGLU):
            if not bank.experts_per_layer:
                bank.experts_per_layer = glu.gate_proj.weight.shape[0]
            mlp.switch_mlp = StreamedSwitchGLU(idx, as_template(glu, bank.spec), bank)
            layers.append(idx)
    if layers:  # after it the forward evaluates: its call never leaves a read deferred
        bank.last_layers.add(max(layers))
    log.debug("streamed banks installed layers=%d", len(layers))
    return layers


# Prefetch hooks: the model side of pool.prefetch (its MoE modules call the guess; the
# parameter tree is unchanged: the modules change class, not contents).
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
    # Keyed by each bank's own layer number: a pipelined model's ``layers`` start mid-model.
    moes = [
        (layer.mlp.switch_mlp.layer, layer.mlp)
        for layer in model.layers
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
