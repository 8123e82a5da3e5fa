"""The pool's policy for decode's layer cycle ("cycle", the default): give up the expert with the
fewest expected hits per slot-step until its layer comes round again.

Decode visits the MoE layers in a cycle, one call each per token. An expert of layer L is asked
for again only when L comes round: right after L's call that is a whole token away, while an
expert of the next layer, used a token ago, may be needed now. Recency (LRU) and use counts
(LFU) ignore that distance, so they keep the experts just used and give up the ones needed
next (the Least-Stale argument). Here each expert held is scored

    p(its class) / d

where ``d`` is the number of layer calls until its layer's next call (1 for the layer that
comes next, the whole cycle for the layer just called) and ``p`` the chance it is routed at
that call: hits per slot per layer call, as LHD ranks a cache by hit density. The lowest score
is given up first.

Invariants:
- ``p`` is learned online from the routing itself, per class: whether the expert is in the
  router's forecast for the next layer (``forecast``: the next layer's router applied to this
  layer's input, ``Prefetcher``), and how many of its layer's calls ago it was last routed to
  (bucketed). At each call every expert of the layer is counted, held or not, so the classes
  measure the workload's reuse, hot experts and the forecast's precision, not the pool's luck.
- An expert forecast for the coming layer scores as an expert needed in one call: it is given
  up only for another expert as likely to be needed as soon, never for one of the layer just
  called (needed a token later at the earliest).
- Pure bookkeeping over slot numbers (no MLX): the table (``slots.SlotTable``) says which slots
  are held; this policy only ranks the others. Every miss is admitted (the kernel reads only
  the pool); the ranking decides what leaves.
- A slot's class is kept between calls and computed again only when it can have changed: its
  layer was called, the forecast for its layer changed, or another expert was placed in it.
  The scores are then those computed afresh for every slot, bit for bit (the same arithmetic
  on the same values), so the victims are too; a call's own host work scans the pool only in
  numpy, never slot by slot in Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

Key = tuple[int, int]  # (layer, expert)
# Calls since an expert of the layer was last routed to, bucketed: 1, 2, 3, 4, 5-8, 9-16,
# 17-32, 33+ (never routed counts as 33+).
_AGES = np.array([1, 2, 3, 4, 5, 9, 17, 33])
# Its uses, each weighing DECAY^(calls of its layer since): hot experts stand out at any age.
_USES = np.array([0.0, 0.5, 1.5, 3.0, 6.0, 12.0, 24.0])
DECAY = 1.0 - 1.0 / 128
CLASSES = 2 * len(_AGES) * len(_USES)  # x (forecast for the next call or not)
# Per age (at most _AGES[-1]), its bucket's first class: a lookup, not a search, per expert. An
# age is never negative (an expert is last routed at its layer's current call at the latest) and
# 0 counts as 1.
_AGE_CLASS = (np.searchsorted(_AGES, np.maximum(np.arange(_AGES[-1] + 1), 1), side="right") - 1) \
    * len(_USES)
_NEVER = 1 << 30
PRIOR_WEIGHT = 4.0  # pseudo-counts: a class seen a few times is scored near the prior
HALVE_AT = 1 << 22  # counted experts between halvings of every count (the classes keep adapting)


class Ranker(Protocol):
    """What ``slots.SlotTable`` asks of a policy that ranks its slots itself and admits every
    miss (``LayerCycle``, or a bench's Belady): told every call's routing, the forecast, and
    every move of an expert; asked for victims among the slots not held."""

    def visit(self, layer: int, experts: Iterable[int]) -> None: ...
    def forecast(self, layer: int, experts: Iterable[int]) -> None: ...
    def placed(self, slot: int, key: Key) -> None: ...
    def left(self, slot: int) -> None: ...
    def victims(self, n: int, held: set[int]) -> list[int]: ...
    def resize(self, capacity: int, owners: Sequence[Key | None]) -> None: ...


class LayerCycle:
    """Ranks the slots of a pool for decode's layer cycle; see the module docstring."""

    def __init__(self, capacity: int, experts_per_layer: int = 0) -> None:
        self._pos: dict[int, int] = {}  # layer -> its place in the cycle (ascending layers)
        self._pos_of = np.zeros(0, dtype=np.int64)  # per row, its layer's place in the cycle
        self._row: dict[int, int] = {}  # layer -> its row in the arrays below
        self._last = np.full((0, experts_per_layer), -_NEVER, dtype=np.int64)  # routed at call
        self._uses = np.zeros((0, experts_per_layer))  # decayed uses
        self._visits = np.zeros(0, dtype=np.int64)  # per row, the layer's calls so far
        self._at: int | None = None  # the layer called last
        self._forecast: tuple[int, set[int]] | None = None  # (layer, experts) guessed for it
        self._forecast_mask: np.ndarray | None = None  # its experts as a mask (None: to make)
        self._seen = np.zeros(CLASSES)
        self._routed = np.zeros(CLASSES)
        self._chances: np.ndarray | None = None  # of the counts as they are (None: to compute)
        self._counted = 0
        self.resize(capacity, [None] * capacity)

    # what the table tells it ------------------------------------------------------------------
    def resize(self, capacity: int, owners: Sequence[Key | None]) -> None:
        """The slots are renumbered (``SlotTable.resize``): ``owners[slot]`` holds now."""
        self._rows = np.full(capacity, -1, dtype=np.int64)  # per slot, its layer's row
        self._expert = np.zeros(capacity, dtype=np.int64)
        # Per slot, its class at its layer's next call, as last computed: a slot's class
        # changes only when its layer is called, the forecast for its layer changes or another
        # expert is placed in it, and each of those marks it stale (computed again by ``scores``).
        self._cls = np.zeros(capacity, dtype=np.int64)
        self._stale_rows: set[int] = set()
        self._stale_slots: set[int] = set()
        for slot, key in enumerate(owners):
            if key is not None:
                self.placed(slot, key)

    def placed(self, slot: int, key: Key) -> None:
        self._rows[slot] = self._grow(*key)
        self._expert[slot] = key[1]
        self._stale_slots.add(slot)

    def left(self, slot: int) -> None:
        self._rows[slot] = -1

    def forecast(self, layer: int, experts: Iterable[int]) -> None:
        """The router's guess of ``layer``'s experts for its coming call."""
        if self._forecast is not None:
            self._stale(self._forecast[0])
        self._forecast, self._forecast_mask = (layer, set(experts)), None
        self._stale(layer)

    def _stale(self, layer: int) -> None:
        """The classes of ``layer``'s slots are to be computed again."""
        row = self._row.get(layer)
        if row is not None:
            self._stale_rows.add(row)

    def visit(self, layer: int, experts: Iterable[int]) -> None:
        """``layer`` is called with these experts routed: count every expert of the layer in
        its class (routed or not), then remember these as routed now."""
        routed = sorted(set(experts))
        if not routed:
            return
        ids = np.array(routed, dtype=np.int64)
        row = self._grow(layer, routed[-1])
        if layer != self._at:  # a call in groups visits once
            self._visits[row] += 1
            self._uses[row] *= DECAY
        self._at = layer
        guess = self._forecast
        if guess is not None and guess[0] == layer:
            self._forecast, self._forecast_mask = None, None
        # Every expert of the layer, as it is now: its row read whole (no gather), and the
        # forecast named only if it is for this layer.
        age = self._visits[row] - self._last[row]
        named = self._named(guess[1], self._last.shape[1]) \
            if guess is not None and guess[0] == layer else None
        cls = self._class_of(age, self._uses[row], named)
        self._chances = None
        self._seen += np.bincount(cls, minlength=CLASSES)
        self._routed += np.bincount(cls[ids], minlength=CLASSES)
        self._counted += cls.size
        if self._counted >= HALVE_AT:
            self._counted, self._seen, self._routed = 0, self._seen / 2, self._routed / 2
        self._last[row, ids] = self._visits[row]
        self._uses[row, ids] += 1.0
        self._stale_rows.add(row)

    def _grow(self, layer: int, expert: int) -> int:
        """The layer's row, the arrays grown to hold it and ``expert``."""
        row = self._row.get(layer)
        if row is None:
            row = self._row[layer] = len(self._row)
            self._pos = {m: i for i, m in enumerate(sorted(self._row))}
            # Per row (rows in the order layers came), its place in the cycle.
            self._pos_of = np.array([self._pos[m] for m in self._row], dtype=np.int64)
        rows, cols = max(row + 1, self._last.shape[0]), max(expert + 1, self._last.shape[1])
        if (rows, cols) != self._last.shape:
            last = np.full((rows, cols), -_NEVER, dtype=np.int64)
            uses = np.zeros((rows, cols))
            visits = np.zeros(rows, dtype=np.int64)
            r, c = self._last.shape
            last[:r, :c], uses[:r, :c], visits[:r] = self._last, self._uses, self._visits
            self._last, self._uses, self._visits = last, uses, visits
        return row

    def _classes(self, rows: np.ndarray, experts: np.ndarray, ahead: int,
                 guess: tuple[int, set[int]] | None) -> np.ndarray:
        """The class of each (row, expert) as it is (``ahead`` 0) or will be at its layer's
        next call (``ahead`` 1): age, decayed uses, and whether ``guess`` names it."""
        age = self._visits[rows] + ahead - self._last[rows, experts]
        uses = self._uses[rows, experts] * DECAY if ahead else self._uses[rows, experts]
        named = None
        if guess is not None and guess[0] in self._row:
            named = (rows == self._row[guess[0]]) & self._forecast_named(guess)[experts]
        return self._class_of(age, uses, named)

    @staticmethod
    def _class_of(age: np.ndarray, uses: np.ndarray, named: np.ndarray | None) -> np.ndarray:
        """The class of each expert from its age, decayed uses and whether the forecast names
        it (``named``: a mask, or None for none)."""
        cls = _AGE_CLASS[np.minimum(age, _AGES[-1])] + np.searchsorted(_USES, uses, side="right")
        cls -= 1
        if named is not None:
            cls[named] += CLASSES // 2
        return cls

    def _forecast_named(self, guess: tuple[int, set[int]]) -> np.ndarray:
        """``_named`` of the forecast, kept until it changes (or the arrays grow)."""
        mask = self._forecast_mask
        if guess is not self._forecast or mask is None or mask.size != self._last.shape[1]:
            mask = self._named(guess[1], self._last.shape[1])
            if guess is self._forecast:
                self._forecast_mask = mask
        return mask

    @staticmethod
    def _named(guess: set[int], experts: int) -> np.ndarray:
        """Per expert id below ``experts``, whether ``guess`` names it."""
        mask = np.zeros(experts, dtype=bool)
        mask[[e for e in guess if 0 <= e < experts]] = True
        return mask

    # what it tells the table ------------------------------------------------------------------
    def chances(self) -> np.ndarray:
        """Per class, the chance an expert of it is routed at its layer's next call."""
        if self._chances is None:  # the counts change only when a layer is called
            prior = self._routed.sum() / max(self._seen.sum(), 1.0)
            self._chances = (self._routed + PRIOR_WEIGHT * prior) / (self._seen + PRIOR_WEIGHT)
        return self._chances

    def scores(self) -> np.ndarray:
        """Per slot, expected hits per layer call until its layer's next call (inf: empty)."""
        used = self._rows >= 0
        out = np.full(self._rows.size, np.inf)
        if not used.any():
            return out
        if self._at is None:  # no call seen yet: nothing tells the held experts apart
            out[used] = 0.0
            return out
        cycle = len(self._pos)
        dist = (self._pos_of - self._pos[self._at]) % cycle  # per row, calls until its next
        dist[dist == 0] = cycle
        self._refresh()
        out[used] = self.chances()[self._cls[used]] / dist[self._rows[used]]
        return out

    def _refresh(self) -> None:
        """Compute again the classes of the stale slots (those of the stale rows, and those
        placed since): the same classes as computing every slot's, for a few layers' slots."""
        if not self._stale_rows and not self._stale_slots:
            return
        stale = np.zeros(len(self._row) + 1, dtype=bool)  # the last entry: an empty slot's (-1)
        stale[list(self._stale_rows)] = True
        marked = stale[self._rows]
        marked[list(self._stale_slots)] = True
        marked &= self._rows >= 0
        idx = np.flatnonzero(marked)
        self._cls[idx] = self._classes(self._rows[idx], self._expert[idx], 1, self._forecast)
        self._stale_rows.clear()
        self._stale_slots.clear()

    def below(self, n: int, held: set[int], layer: int, experts: list[int]) -> list[int]:
        """Up to ``n`` slots outside ``held`` scored below every one of ``layer``'s guessed
        ``experts`` would be (a read-ahead gives up no expert worth more than what it reads)."""
        if self._at is None or layer not in self._pos:
            return []
        row = self._grow(layer, max(experts))
        cls = self._classes(np.full(len(experts), row), np.array(experts), 1, self._forecast)
        dist = (self._pos[layer] - self._pos[self._at]) % len(self._pos) or len(self._pos)
        return _lowest(self.scores(), n, held, float(self.chances()[cls].min()) / dist)

    def victims(self, n: int, held: set[int]) -> list[int]:
        """Up to ``n`` occupied slots outside ``held``, the lowest scores first."""
        return _lowest(self.scores(), n, held, np.inf)


def _lowest(score: np.ndarray, n: int, held: set[int], bar: float) -> list[int]:
    """Up to ``n`` slots outside ``held`` scored below ``bar``, the lowest first."""
    if held:
        score[list(held)] = np.inf
    cand = np.flatnonzero(score < bar)
    if cand.size > n:
        cand = cand[np.argpartition(score[cand], n - 1)[:n]]
    return cand[np.argsort(score[cand], kind="stable")].tolist()
