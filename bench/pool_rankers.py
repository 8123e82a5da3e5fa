"""Baseline rankers for the pool's ``SlotTable`` (``slots.Ranker``): every miss admitted, as the
pool must, and the slots ranked by LRU, LFU, Belady's MIN, or the generator's own law.

- ``Lru``: the slot whose expert was routed longest ago goes first.
- ``Lfu``: the expert routed least often (every use counted since the start, held or not:
  "perfect" LFU) goes first, the least recent among equals.
- ``Belady``: the expert whose next use is farthest in the future goes first (MIN). With every
  miss admitted and a call's own experts held, that is the most hits any policy can have on the
  trace (demand paging, Belady 1966 / Mattson et al. 1970).
- ``Oracle``: knows the law a ``cycle_traces`` trace is drawn from (each expert's chance of
  being routed at its layer's next call, given the last routing and the forecast) but not the
  draws; it ranks by that chance per layer call until the call, as ``LayerCycle`` does with
  learned chances. The online ceiling: what the cycle policy could do with perfect estimates.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

Key = tuple[int, int]


class _Slots:
    """Which (layer, expert) each slot holds, as arrays."""

    def __init__(self, capacity: int) -> None:
        self.resize(capacity, [None] * capacity)

    def resize(self, capacity: int, owners: Sequence[Key | None]) -> None:
        self.layer = np.full(capacity, -1, dtype=np.int64)
        self.expert = np.zeros(capacity, dtype=np.int64)
        self.value = np.zeros(capacity)  # the ranking: lowest goes first
        self.slot: dict[Key, int] = {}
        for s, key in enumerate(owners):
            if key is not None:
                self.placed(s, key)

    def placed(self, slot: int, key: Key) -> None:
        self.slot[key] = slot
        self.layer[slot], self.expert[slot] = key
        self.value[slot] = self.value_of(key)

    def value_of(self, key: Key) -> float:
        return 0.0

    def left(self, slot: int) -> None:
        self.slot.pop((int(self.layer[slot]), int(self.expert[slot])), None)
        self.layer[slot] = -1

    def forecast(self, layer: int, experts: Iterable[int]) -> None:
        pass

    def ranked(self, n: int, held: set[int], value: np.ndarray) -> list[int]:
        ok = self.layer >= 0
        if held:
            ok[list(held)] = False
        v, cand = value, np.flatnonzero(ok)
        if cand.size > n:
            cand = cand[np.argpartition(v[cand], n - 1)[:n]]
        return cand[np.argsort(v[cand], kind="stable")].tolist()

    def victims(self, n: int, held: set[int]) -> list[int]:
        return self.ranked(n, held, self.value)


class Lru(_Slots):
    def __init__(self, capacity: int) -> None:
        self.clock = 0
        super().__init__(capacity)

    def value_of(self, key: Key) -> float:
        return float(self.clock)

    def visit(self, layer: int, experts: Iterable[int]) -> None:
        self.clock += 1
        for e in experts:
            if (s := self.slot.get((layer, e))) is not None:
                self.value[s] = self.clock


class Lfu(_Slots):
    def __init__(self, capacity: int) -> None:
        self.clock = 0
        self.count: dict[Key, int] = {}
        super().__init__(capacity)

    def value_of(self, key: Key) -> float:
        return self.count.get(key, 0) + self.clock * 1e-9  # the least recent among equals

    def visit(self, layer: int, experts: Iterable[int]) -> None:
        self.clock += 1
        for e in experts:
            key = (layer, e)
            self.count[key] = self.count.get(key, 0) + 1
            if (s := self.slot.get(key)) is not None:
                self.value[s] = self.value_of(key)


class Belady(_Slots):
    """MIN over a known sequence of calls ``(layer, experts)``: visits must follow it."""

    def __init__(self, capacity: int, calls: Sequence[tuple[int, Sequence[int]]]) -> None:
        self.uses: dict[Key, list[int]] = {}
        for i, (layer, ids) in enumerate(calls):
            for e in ids:
                self.uses.setdefault((layer, e), []).append(i)
        self.calls = calls
        self.at = -1
        self.last_layer: int | None = None
        super().__init__(capacity)

    def value_of(self, key: Key) -> float:
        uses = self.uses.get(key, [])
        i = int(np.searchsorted(uses, self.at, side="right"))  # the next use after this call
        return -float(uses[i]) if i < len(uses) else -np.inf  # farthest (most negative) first

    def visit(self, layer: int, experts: Iterable[int]) -> None:
        if layer != self.last_layer:  # a call in groups is one call
            self.at += 1
            self.last_layer = layer
            assert self.calls[self.at][0] == layer, "visits must follow the calls"
        for e in experts:
            if (s := self.slot.get((layer, e))) is not None:
                self.value[s] = self.value_of((layer, e))


class Oracle(_Slots):
    """The online ceiling on a ``cycle_traces`` trace: chances from the generator's law."""

    def __init__(self, capacity: int, keep: float, popularity: np.ndarray, top_k: int,
                 rank1: float, rest: float) -> None:
        self.layers, experts = popularity.shape
        self.keep, self.k = keep, top_k
        # A fresh draw's chance of picking an expert: about 1-(1-p)^(draws), draws = k(1-keep).
        self.fresh = 1.0 - (1.0 - popularity) ** (top_k * (1.0 - keep))
        self.popularity = popularity
        self.rank = np.r_[rank1, np.full(top_k - 1, rest)]
        self.routed_last = np.zeros(popularity.shape, dtype=bool)
        self.at = -1
        self.guess: tuple[int, np.ndarray] | None = None  # (layer, per expert its chance)
        super().__init__(capacity)

    def visit(self, layer: int, experts: Iterable[int]) -> None:
        self.routed_last[layer] = False
        self.routed_last[layer, list(experts)] = True
        self.at = layer
        if self.guess is not None and self.guess[0] == layer:
            self.guess = None

    def forecast(self, layer: int, experts: Iterable[int]) -> None:
        ids = list(experts)
        p = self.popularity[layer].copy()
        missing = self.k - self.rank.sum()  # routed experts the guess does not name, expected
        p[ids] = 0.0
        chance = np.minimum(1.0, missing * p / p.sum())
        chance[ids] = self.rank[: len(ids)]
        self.guess = (layer, chance)

    def victims(self, n: int, held: set[int]) -> list[int]:
        lay = np.maximum(self.layer, 0)
        f = self.fresh[lay, self.expert]
        chance = np.where(self.routed_last[lay, self.expert], self.keep + (1 - self.keep) * f, f)
        if self.guess is not None:
            mine = lay == self.guess[0]
            chance[mine] = self.guess[1][self.expert[mine]]
        dist = (lay - self.at) % self.layers
        dist[dist == 0] = self.layers
        return self.ranked(n, held, chance / dist)
