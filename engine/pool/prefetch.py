"""Next-layer read-ahead: guess layer L+1's experts from layer L's MoE input.

The hidden state changes little from one layer to the next, so layer L+1's own router applied
to layer L's MoE input picks most of the experts L+1 will route to. In a call too small to sort
(decode), the guessed experts no slot holds are read into free slots of the pool while layer L
computes; otherwise (prefill) the daemon gets a hint and fetches missing ones meanwhile.

Invariants:
- A guess never changes a token: it is computed beside the model, never fed into it, and the
  real routing of L+1 is still read back and served in full; a wrong guess costs bandwidth.
- No extra sync: the guess is evaluated together with layer L's routing read-back.
- Experts already in the pool are neither read nor hinted; an empty hint is not sent.
- Read-ahead never takes a slot that queued work reads, and never delays a demanded expert: a
  guess is read on background threads, and a call waits only for the reads of experts it
  routes to.
- The model's MoE modules call ``guess`` (``cachecd_engine.streamed_moe.install_prefetch``).
"""

from __future__ import annotations

import logging
import sys

import mlx.core as mx
import numpy as np
from mlx import nn

from cachecd import errors
from cachecd_engine.pool.bank import ExpertBank
from cachecd_engine.pool.dispatch import SORT_ROWS

log = logging.getLogger(__name__)


def read_ahead_by_default() -> bool:
    """Off everywhere it was measured side by side (bench/k3_decode.py, pc vs pc-ahead): on the
    CPU the read-ahead's copies take the cores the compute needs (0.73-0.78x of the resident
    model's tokens/s with it, 0.73-0.98x without); on the H200 (CUDA) a pool smaller than the
    working set ran 0.39 decode steps a second with it and 0.47 without (read-ahead then wrote
    the GPU's pages from the host; it now goes through the copy engine, not yet measured there). With the disk throttled
    (``--throttle``, issue 37) it paid only where a token's reads took about its compute (1.5
    GB/s here: 0.780 against 0.611 tok/s); with the disk far slower than compute, as a Mac's
    SSD is beside K3's compute (0.2 GB/s here: 0.114 against 0.126), or far faster (13.6 GB/s:
    0.975 against 1.020), the guesses it reads that are not routed (29% more bytes) cost more
    than the overlap gives. Metal is not measured."""
    return False


def route(moe: nn.Module, x: mx.array) -> mx.array:
    """The experts ``moe``'s router picks for ``x`` (lazy), with the model's own selection."""
    picked = moe.gate(x)
    if isinstance(picked, tuple):  # deepseek_v3 / kimi_k2: the gate returns (indices, scores)
        return picked[0]
    args = moe.args  # kimi_k3: the gate is a Linear; the module's own function selects
    select = getattr(sys.modules[type(moe).__module__], "_group_expert_select", None)
    if select is not None:
        return select(picked, moe.e_score_correction_bias, args.num_experts_per_token,
                      args.num_expert_group, args.topk_group, args.routed_scaling_factor,
                      args.moe_renormalize)[0]
    scores = mx.sigmoid(picked.astype(mx.float32)) + moe.e_score_correction_bias
    k = args.num_experts_per_token
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


class Prefetcher:
    """Holds each MoE layer's pending guess for the next MoE layer until its read-back."""

    def __init__(self, bank: ExpertBank, next_gates: dict[int, tuple[int, nn.Module]]) -> None:
        self.bank = bank
        self.next_gates = next_gates  # layer -> (next MoE layer, its SparseMoE module)
        self._pending: dict[int, mx.array] = {}
        self._guessed: dict[int, set[int]] = {}  # next layer -> the experts guessed for it
        self.hinted = 0  # experts hinted since construction
        self.hints = 0  # hint calls
        self.guessed = 0  # experts guessed that the layer then routed to ...
        self.routed = 0  # ... out of the experts routed in layers that had a guess

    def guess(self, layer: int, x: mx.array) -> None:
        """Record a lazy guess of the next MoE layer's experts from this layer's MoE input."""
        nxt = self.next_gates.get(layer)
        spec = self.bank.speculator
        if nxt is not None and not (spec is not None and spec.active):
            self._pending[layer] = route(nxt[1], x)

    def take(self, layer: int) -> mx.array | None:
        return self._pending.pop(layer, None)

    def score(self, layer: int, ids: set[int]) -> None:
        """Count how much of this layer's routing its guess had (the guess's recall)."""
        guessed = self._guessed.pop(layer, None)
        if guessed is not None:
            self.guessed += len(guessed.intersection(ids))
            self.routed += len(ids)

    @property
    def recall(self) -> float:
        return self.guessed / self.routed if self.routed else 0.0

    def forecast(self, layer: int, guess: np.ndarray, rows: int) -> None:
        """Tell the pool's policy the next layer's guess before this layer's call claims slots
        (``LayerCycle``: an expert guessed for the coming layer is kept); decode only."""
        table = self.bank.table
        if table is not None and layer in self.next_gates and rows < SORT_ROWS:
            table.forecast(self.next_gates[layer][0], np.unique(guess).tolist())

    def send(self, layer: int, guess: np.ndarray, rows: int) -> None:
        next_layer, _ = self.next_gates[layer]
        ids = np.unique(guess).tolist()
        self._guessed[next_layer] = set(ids)
        if rows < SORT_ROWS:  # read into free slots of the pool while this layer computes
            self.bank.stage(next_layer, ids)
            return
        ids = [e for e in ids if not self.bank.holds(next_layer, e)]
        if not ids:
            return
        self.hints += 1
        self.hinted += len(ids)
        try:
            self.bank.source.prefetch(next_layer, ids)
        except (errors.CachecdError, OSError, RuntimeError) as exc:  # never break a token
            log.debug("prefetch hint failed layer=%d err=%s", next_layer, exc)
