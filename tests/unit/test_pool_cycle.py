"""The pool's default policy (``cachecd_engine.pool.cycle.LayerCycle``) on decode's layer cycle,
driven as the bank drives the table (``cachecd.plan.simulate.through_pool``)."""

from __future__ import annotations

import numpy as np

from cachecd.plan.simulate import through_pool
from cachecd_engine.pool.cycle import LayerCycle
from cachecd_engine.pool.slots import SlotTable


def _hit_rate(table: SlotTable, calls: list[tuple[int, list[int]]], tokens: int,
              counted_from: int) -> float:
    hits = asked = 0
    for token in range(tokens):
        for layer, ids in calls:
            _, held = through_pool(table, layer, ids)
            if token >= counted_from:
                hits, asked = hits + len(held), asked + len(ids)
    return hits / asked


def test_a_pool_smaller_than_the_cycle_keeps_the_next_layers_expert() -> None:
    """Three layers, each routing to the same expert every token, two slots: recency and use
    counts give up the expert needed next as often as the one needed last (1 hit in 3 calls,
    the store's lru and wlfu, the default before); the cycle policy gives up the one needed
    last and hits every other call, as Belady does."""
    calls = [(0, [7]), (1, [7]), (2, [7])]
    assert _hit_rate(SlotTable(2), calls, tokens=40, counted_from=10) >= 0.45
    for old in ("lru", "wlfu"):
        assert _hit_rate(SlotTable(2, old), calls, tokens=40, counted_from=10) < 0.4


def test_an_expert_forecast_for_the_next_layer_is_kept() -> None:
    """Layer 1's expert 5 was read ahead and never routed. The router's forecasts have named
    experts layer 1 then routed to; when it names expert 5, layer 0's miss takes another slot;
    without the forecast, expert 5 (never routed) is the one given up."""
    for forecast in (True, False):
        table = SlotTable(4)
        for token in range(40):  # layer 1 routes to the new expert the forecast names
            table.forecast(1, [100 + token])
            through_pool(table, 0, [token % 2])
            through_pool(table, 1, [100 + token, 10 + token % 2])
        table.filled(table.claim(1, [5]).slots.values())  # read ahead, never routed
        if forecast:
            table.forecast(1, [5])
        through_pool(table, 0, [2])
        assert ((1, 5) in table) is forecast


def test_read_ahead_never_takes_a_kept_expert() -> None:
    """A full pool of the experts the coming layers route to again: a read-ahead of guesses
    takes no slot of theirs (today's 8-slot pool gave 4 of them to 4 guesses)."""
    table = SlotTable(8)
    for _ in range(20):  # each layer routes to the same 4 experts every token
        through_pool(table, 0, [0, 1, 2, 3])
        through_pool(table, 1, [4, 5, 6, 7])
    table.forecast(1, [20, 21, 22, 23])
    through_pool(table, 0, [0, 1, 2, 3])
    got = table.claim(1, [20, 21, 22, 23], take_fenced=False, ahead=True)
    assert got.slots == {} and {(1, e) for e in (4, 5, 6, 7)} <= {k for k, _ in table.items()}
    lru = SlotTable(8, "lru")  # a store policy's table reads ahead into free slots only
    through_pool(lru, 0, [0, 1, 2, 3])
    through_pool(lru, 1, [4, 5, 6, 7])
    assert lru.claim(1, [20, 21], take_fenced=False, ahead=True).slots == {}


def test_read_ahead_takes_what_is_worth_less_than_the_guess() -> None:
    """Slots of experts routed once long ago are worth less than a forecast expert: a
    read-ahead takes them."""
    table = SlotTable(6)
    through_pool(table, 1, [30, 31])  # routed once, never again
    for token in range(20):
        table.forecast(1, [token % 2 + 10])
        through_pool(table, 0, [0, 1])
        through_pool(table, 1, [token % 2 + 10])
    table.forecast(1, [12, 13])
    through_pool(table, 0, [0, 1])
    got = table.claim(1, [12, 13], take_fenced=False, ahead=True)
    assert sorted(got.slots) == [12, 13] and (1, 30) not in table and (1, 31) not in table


def test_a_swap_moves_what_the_ranker_knows_with_the_experts() -> None:
    """``SlotTable.swap`` (a Metal call brought within one window) exchanges two slots'
    experts: the cycle ranker then scores each slot as the expert it holds now, an emptied slot
    as empty, and the table's maps agree."""
    table = SlotTable(6, experts_per_layer=8)
    for layer, ids in ((1, [0, 1, 2]), (2, [3, 4])):
        claim = table.claim(layer, ids, use=True)
        table.filled(claim.slots.values())
        table.use(layer, ids)
    before = table.ranker.scores().copy()
    a, b = table.slot((1, 0)), table.slot((2, 3))
    empty = next(s for s in range(6) if table.owner(s) is None)
    c = table.slot((1, 2))
    table.swap([(a, b), (c, empty)])
    assert table.slot((1, 0)) == b and table.slot((2, 3)) == a
    assert table.slot((1, 2)) == empty and table.owner(c) is None
    after = table.ranker.scores()
    assert after[b] == before[a] and after[a] == before[b]
    assert after[empty] == before[c] and after[c] == before[empty]
    claim = table.claim(3, [7])
    assert claim.slots[7] == c  # the slot emptied is the free one handed out


def test_the_scores_kept_between_calls_are_those_computed_afresh() -> None:
    """The ranker keeps each slot's class between calls and computes again only those whose
    layer was called, whose layer's forecast changed or that took another expert (a pool of
    thousands of slots is not scanned in Python per call). Through calls, forecasts, swaps and
    forgotten reads of a 3-layer cycle, its scores equal a twin's whose every class is computed
    afresh before each look (``resize`` places every slot again)."""
    rng = np.random.default_rng(0)
    table = SlotTable(24, experts_per_layer=16)
    twin = LayerCycle(24, 16)
    assert table.ranker is not None
    ranker = table.ranker
    table.ranker = _Both(ranker, twin)
    for call in range(300):
        layer = call % 3
        if rng.random() < 0.7:  # the next layer's guess, now and then another layer's
            guessed = (layer + 1) % 3 if rng.random() < 0.7 else int(rng.integers(3))
            table.forecast(guessed, rng.choice(16, 4, replace=False).tolist())
        through_pool(table, layer, rng.choice(16, 6, replace=False).tolist())
        if call % 17 == 0:  # a read-ahead that failed: the slot is freed
            table.forget([table.slot(next(iter(k for k, _ in table.items())))])
        if call % 23 == 0:  # a Metal call brought within one window, its readers evaluated
            table.clear_fences(table.fenced())
            table.swap([(0, 1 + call % 20)])
        twin.resize(24, [table.owner(s) for s in range(24)])
        assert np.array_equal(ranker.scores(), twin.scores())


class _Both:
    """Tells two rankers every event; ranks as the first."""

    def __init__(self, first: LayerCycle, second: LayerCycle) -> None:
        self.first, self.second = first, second

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        def both(*args, **kwargs):  # type: ignore[no-untyped-def]
            getattr(self.second, name)(*args, **kwargs)
            return getattr(self.first, name)(*args, **kwargs)
        return both


def test_a_pool_filled_before_any_call_can_shrink() -> None:
    """Experts claimed before any layer call was seen (a bench filling the pool, a read-ahead
    at start): a resize that keeps fewer gives some up rather than failing for want of a
    ranking."""
    t = SlotTable(8, experts_per_layer=16)
    got = t.claim(1, [1, 2, 3, 4, 5, 6], use=False)
    t.filled(got.slots.values())
    moves = t.resize(3)
    assert len(moves) == 3 and len(t) == 3 and t.capacity == 3
