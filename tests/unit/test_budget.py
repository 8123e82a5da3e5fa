"""Budget accounting and the eviction policies (pure in-memory logic, real objects)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachecd import errors
from cachecd.store.budget import Budget, Reservation
from cachecd.store.policies import LFUDA, LRU, WindowLFU, make_policy


class Model:
    """A budget plus committed entries and pins, the way the store drives them."""

    def __init__(self, limit: int, policy: str = "lru") -> None:
        self.budget = Budget(limit)
        self.policy = make_policy(policy)
        self.sizes: dict[str, int] = {}
        self.pins: set[str] = set()

    def pick(self, need: int) -> list[tuple[str, int]]:
        return [(d, self.sizes[d]) for d in self.policy.victims(need, self.pins)]

    def reserve(self, n: int) -> Reservation:
        res, victims = self.budget.reserve(n, self.pick, self.budget.release)
        for d, _ in victims:
            del self.sizes[d]
            self.policy.on_remove(d)
        return res

    def commit(self, name: str, res: Reservation, size: int) -> None:
        self.budget.commit(res, size)
        self.sizes[name] = size
        self.policy.on_insert(name, size)


def test_reserve_commit_release_accounting() -> None:
    m = Model(1000)
    r1 = m.reserve(400)
    assert (m.budget.used, m.budget.reserved) == (0, 400)
    m.commit("a", r1, 300)  # smaller than reserved is fine
    assert (m.budget.used, m.budget.reserved) == (300, 0)
    r2 = m.reserve(700)
    r2.release()
    r2.release()  # idempotent
    assert m.budget.reserved == 0
    with pytest.raises(errors.Internal):
        m.budget.commit(r2, 10)
    r3 = m.reserve(100)
    with pytest.raises(errors.InvalidRequest):
        m.budget.commit(r3, 101)


def test_too_large_at_once_and_reservations_full() -> None:
    m = Model(1000)
    with pytest.raises(errors.TooLarge):
        m.reserve(1001)
    m.commit("a", m.reserve(500), 500)
    m.pins.add("a")
    m.reserve(400)
    with pytest.raises(errors.ReservationsFull):
        m.reserve(200)  # 100 free, "a" pinned, 400 reserved
    assert m.budget.used + m.budget.reserved <= 1000


def test_eviction_frees_exactly_what_is_needed_in_policy_order() -> None:
    m = Model(300)
    for name in "abc":
        m.commit(name, m.reserve(100), 100)
    m.policy.on_access("a")
    m.commit("d", m.reserve(150), 150)  # needs 150: b then c go, a (recent) stays
    assert set(m.sizes) == {"a", "d"} and m.budget.used == 250


def test_unlimited_budget_never_evicts() -> None:
    m = Model(0)
    for i in range(100):
        m.commit(str(i), m.reserve(10**9), 10**9)
    assert len(m.sizes) == 100


def test_negative_sizes_rejected() -> None:
    with pytest.raises(errors.InvalidRequest):
        Budget(-1)
    with pytest.raises(errors.InvalidRequest):
        Model(10).reserve(-5)


@settings(max_examples=60, deadline=None)
@given(
    limit=st.integers(1, 2000),
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "fail", "pin", "unpin"]), st.integers(0, 600)),
        max_size=80,
    ),
    policy=st.sampled_from(["lru", "lfuda"]),
)
def test_budget_invariant_holds_under_any_sequence(
    limit: int, ops: list[tuple[str, int]], policy: str
) -> None:
    m = Model(limit, policy)
    open_res: list[Reservation] = []
    for i, (op, n) in enumerate(ops):
        held = {p for p in m.pins if p in m.sizes}
        try:
            if op == "put":
                m.commit(f"e{i}", m.reserve(n), n)
            elif op == "fail":
                open_res.append(m.reserve(n))
            elif op == "pin" and m.sizes:
                m.pins.add(sorted(m.sizes)[n % len(m.sizes)])
            elif op == "unpin" and m.pins:
                m.pins.discard(sorted(m.pins)[n % len(m.pins)])
        except (errors.TooLarge, errors.ReservationsFull):
            pass
        assert m.budget.used + m.budget.reserved <= limit
        assert m.budget.used == sum(m.sizes.values())
        if op != "unpin":
            assert held <= set(m.sizes), "a pinned entry was evicted"
        if len(open_res) > 3:
            open_res.pop(0).release()


@pytest.mark.parametrize("cls", [LRU, LFUDA])
def test_victims_skip_excluded_and_do_not_mutate(cls: type[LRU | LFUDA]) -> None:
    p = cls()
    for name in "abcd":
        p.on_insert(name, 10)
    first = p.victims(25, {"a"})
    assert "a" not in first and sum(10 for _ in first) >= 25
    assert p.victims(25, {"a"}) == first  # asking again gives the same answer
    assert len(p) == 4
    assert p.victims(1000, set()) and len(p.victims(1000, set())) == 4


def _hit_rate(policy: str, trace: list[str], capacity: int) -> float:
    p = make_policy(policy)
    present: set[str] = set()
    hits = 0
    for x in trace:
        if x in present:
            hits += 1
            p.on_access(x)
            continue
        if len(present) >= capacity:
            for victim in p.victims(1, set()):
                p.on_remove(victim)
                present.discard(victim)
        p.on_insert(x, 1)
        present.add(x)
    return hits / len(trace)


def test_default_policy_keeps_hot_experts_through_a_scan() -> None:
    hot = [f"h{i}" for i in range(8)]
    trace = hot * 20 + [f"scan{i}" for i in range(12)] + hot * 5
    assert _hit_rate("lfuda", trace, 10) > _hit_rate("lru", trace, 10)
    p = make_policy("default")
    for x in hot:
        p.on_insert(x, 1)
        for _ in range(5):
            p.on_access(x)
    p.on_insert("once", 1)
    assert p.victims(1, set()) == ["once"]


def test_default_policy_ages_out_a_hot_set_that_drifted() -> None:
    old = [f"old{i}" for i in range(5)]
    new = [f"new{i}" for i in range(5)]
    trace = old * 50 + (new + [f"x{i}" for i in range(400)]) * 1
    trace += [x for _ in range(200) for x in new]
    # After the drift the new hot set must be what stays cached (plain LFU would keep the
    # old one: 50 hits each).
    p = make_policy("lfuda")
    present: set[str] = set()
    for x in trace:
        if x in present:
            p.on_access(x)
            continue
        if len(present) >= 8:
            for v in p.victims(1, set()):
                p.on_remove(v)
                present.discard(v)
        p.on_insert(x, 1)
        present.add(x)
    assert set(new) <= present


def test_default_beats_lru_on_skewed_routing() -> None:
    rng = random.Random(3)
    weights = [1 / (r + 1) ** 0.9 for r in range(896)]
    trace = [str(i) for i in rng.choices(range(896), weights=weights, k=20_000)]
    assert _hit_rate("lfuda", trace, 64) > _hit_rate("lru", trace, 64)


def test_unknown_policy() -> None:
    with pytest.raises(errors.InvalidRequest, match="lru"):
        make_policy("fifo")


def test_held_entries_are_spared_until_released() -> None:
    from cachecd.store.index import Entry
    from cachecd.store.ledger import Ledger

    entries = {d: Entry(0, 100, 0.0) for d in ("a", "b", "c")}
    ledger = Ledger(Budget(300), make_policy("lru"), dict(entries), set(), {})
    ledger.hold(["a", "b"])
    ledger.hold(["a"])  # holds nest: two requests need a
    res, victims = ledger.reserve(100)
    assert list(victims.where) == ["c"]
    ledger.settle(victims)
    res.release()
    assert list(ledger.take(["a", "b"]).where) == []  # explicit eviction spares them too
    with pytest.raises(errors.ReservationsFull):
        ledger.reserve(200)  # a and b are all there is, and both are held
    ledger.release_hold(["a", "b"])
    assert list(ledger.take(None, 100).where) == ["b"]  # a is still held once
    ledger.release_hold(["a"])
    assert list(ledger.take(None, 100).where) == ["a"] and not ledger.held


def _state(p: WindowLFU) -> tuple:
    return (list(p._window.items()), dict(p._main), sorted(p._heap), dict(p._counts), p._peak,
            p._share, list(p._ghost_window), list(p._ghost_main))


@pytest.mark.parametrize("share", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 257])
def test_restore_at_open_equals_one_insert_each(share: float, n: int) -> None:
    """The store's open hands the default policy every entry at once (~82k at K3 scale): its
    fast path must leave the policy exactly as inserting them one by one would, and rank the
    same victims before and after more traffic."""
    rng = random.Random(n)
    rows = [(f"d{i}", rng.choice([1, 7, 100]), rng.choice([0, 0, 1, 5])) for i in range(n)]
    fast, slow = WindowLFU(window=share), WindowLFU(window=share)
    fast.restore(rows)
    for digest, size, count in rows:
        slow.on_insert(digest, size, count)
    assert _state(fast) == _state(slow)
    for p in (fast, slow):
        same = random.Random(7)  # the same traffic for both
        for _ in range(3 * n):
            p.on_access(f"d{same.randrange(max(n, 1))}")
        p.on_insert("new", 3)
        p.on_remove(f"d{same.randrange(max(n, 1))}")
    assert fast.victims(10**9, set()) == slow.victims(10**9, set())


def test_restore_into_a_used_policy_falls_back_to_inserts() -> None:
    fast, slow = WindowLFU(), WindowLFU()
    for p in (fast, slow):
        p.on_insert("a", 1)
        p.on_remove("a")  # a ghost now: the next insert of it moves the share
    rows = [("a", 1, 2), ("b", 1, 0), ("c", 1, 3)]
    fast.restore(rows)
    for row in rows:
        slow.on_insert(*row)
    assert _state(fast) == _state(slow)
