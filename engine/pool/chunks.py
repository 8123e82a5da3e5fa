"""One layer's calls from several prefill chunks, each group of experts read once for all of them.

A layer-major prefill (``cachecd_engine.prefill``) runs every chunk of a prompt through layer L
before layer L+1. When the pool holds fewer experts than the layer routes to over the prompt,
running the chunks' calls one after another reads an expert again for every chunk that routes
to it after the pool gave it up. A ``ChunkBatch`` instead takes
the layer's calls in three passes: ``collect`` (each chunk's call is recorded, its routing read
back, and it answers zeros: the prefill throws that run's layer output away, keeping the
attention's output and cache writes), ``compute`` (the calls' rows group by group through
``calls.run_calls``: each group of experts in slots once, every call's rows for it computed),
and ``serve`` (the chunks run the layer again, their attention replayed, and each call is
answered with its computed output).

Invariants:
- A served output is the one computed for exactly that call: the served call's input and
  routing are checked equal (bitwise) to the collected call's (``verify``, once for the window,
  before the prefill goes on), else ``errors.Internal``: nothing computed from another input
  leaves the pass.
- Every row is computed as in a lone call's groups (``calls``: the resident kernel, dummy rows
  where ``dispatch`` asks), so the outputs are bitwise the calls' own.
- The counters see each chunk's call once, as a lone call would count it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from cachecd import errors
from cachecd_engine.pool import dispatch
from cachecd_engine.pool.calls import Call, distinct, run_calls

ExpertBank = Any  # the bank imports this module (``bank.chunks``), so this one may not import it


class ChunkBatch:
    """The calls one layer gets from a window of prefill chunks (``bank.chunks`` while set)."""

    def __init__(self, bank: ExpertBank) -> None:
        self.bank = bank
        self.layer: int | None = None
        self.calls: list[Call] = []
        self.outputs: list[mx.array] = []
        self.served = 0
        self.serving = False
        self.checks: list[mx.array] = []

    def call(self, layer: int, glu: SwitchGLU, x: mx.array, indices: mx.array) -> mx.array:
        if self.layer is None:
            self.layer = layer
        elif layer != self.layer:
            raise errors.Internal(
                f"a grouped prefill pass got calls of MoE layers {self.layer} and {layer}")
        return self._serve(x, indices) if self.serving else self._collect(glu, x, indices)

    def _collect(self, glu: SwitchGLU, x: mx.array, indices: mx.array) -> mx.array:
        bank = self.bank
        fenced = bank.fenced()
        mx.eval(indices, x, *fenced)
        bank.synced(fenced)
        routed = np.array(indices)
        assert self.layer is not None
        if bank.trace is not None:
            bank.trace(self.layer, routed)
        routed_ids = len(distinct(routed))
        s = bank.stats
        s.layer_calls += 1
        s.rows += routed.size
        s.experts_routed += routed_ids
        target = dispatch.resident_kernel(bank.backend, bank.spec.mode is not None, routed.size,
                                          bank.experts_per_layer or routed_ids)
        self.calls.append(Call(glu, x, routed, target))
        return mx.zeros((*indices.shape, x.shape[-1]), x.dtype)

    def compute(self) -> None:
        """Every collected call's output, each group of the experts they route to read once."""
        self.serving = True
        if not self.calls:
            return
        assert self.layer is not None
        ids = sorted(set().union(*(distinct(c.routed) for c in self.calls)))
        self.bank.pool(self.layer, ids[0])
        self.outputs = run_calls(self.bank, self.layer, self.calls, ids)

    def _serve(self, x: mx.array, indices: mx.array) -> mx.array:
        if self.served >= len(self.calls):
            raise errors.Internal(
                f"a grouped prefill pass of MoE layer {self.layer} got more calls than it collected")
        call = self.calls[self.served]
        if x.shape != call.x.shape or indices.shape != call.routed.shape:
            raise errors.Internal(self._differs())
        # Checked lazily: ``verify`` evaluates every check of the window at once, before the
        # prefill goes on (no read-back per call; a wrong answer never leaves the pass).
        self.checks.append(mx.logical_and(
            mx.array_equal(x, call.x, equal_nan=True),
            mx.array_equal(indices, mx.array(call.routed))))
        self.served += 1
        return self.outputs[self.served - 1]

    def verify(self) -> None:
        """Every served call was the one collected (input and routing bitwise), else
        ``errors.Internal``; call before anything computed from the outputs is used."""
        if self.served != len(self.calls):
            raise errors.Internal(f"a grouped prefill pass of MoE layer {self.layer} served "
                                  f"{self.served} of {len(self.calls)} calls")
        if self.checks:
            mx.eval(self.checks)
            if not all(bool(c.item()) for c in self.checks):
                raise errors.Internal(self._differs())

    def _differs(self) -> str:
        return (f"a grouped prefill pass of MoE layer {self.layer}: a call differs from the one "
                "collected; its output is not served")

    def output_nbytes(self) -> int:
        """The memory the collected calls' outputs will take."""
        return sum(c.routed.size * c.x.shape[-1] * c.x.itemsize for c in self.calls)

