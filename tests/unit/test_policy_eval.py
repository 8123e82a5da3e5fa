"""The policy evaluation's parts: Belady against brute force, the replay as the store drives a
policy, trace streams and views, the synthetic generator, the default policy's behaviour, and a
tiny end-to-end run of bench/policy_eval.py (no timing anywhere)."""

from __future__ import annotations

import functools
import itertools
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import policy_eval  # noqa: E402
from policy_sim import LFU, a0_hits, belady_hits, belady_mask, next_use, now_hits, replay  # noqa: E402
from traces import (  # noqa: E402
    KEY_STRIDE,
    Stream,
    SynthSpec,
    read_requests,
    routing_skew,
    synthetic,
)

from cachecd.store.policies import LRU, WindowLFU, make_policy  # noqa: E402
from cachecd_engine.trace import TraceRecorder  # noqa: E402


def _optimal_hits(seq: tuple[int, ...], cap: int) -> int:
    """Exhaustive optimum from the best starting content (demand paging)."""

    @functools.cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(seq):
            return 0
        k = seq[i]
        if k in cache:
            return 1 + best(i + 1, cache)
        if len(cache) < cap:
            return best(i + 1, cache | {k})
        return max(best(i + 1, (cache - {v}) | {k}) for v in cache)

    keys = sorted(set(seq))
    starts = itertools.combinations(keys, min(cap, len(keys)))
    return max(best(0, frozenset(s)) for s in starts)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=11), st.integers(1, 3))
def test_belady_matches_exhaustive_optimum(seq: list[int], cap: int) -> None:
    got = belady_hits(np.array(seq, dtype=np.int64), cap)
    assert got.hits == _optimal_hits(tuple(seq), cap)
    assert got.requests == len(seq)


def test_next_use() -> None:
    assert next_use(np.array([7, 3, 7, 7, 3, 9])).tolist() == [2, 4, 3, 6, 6, 6]


def test_replay_scores_only_the_test_part_and_lru_by_hand() -> None:
    train = np.array([1, 2], dtype=np.int64)
    test = np.array([1, 3, 2, 1, 3], dtype=np.int64)
    # LRU, 2 slots, warmed with [1, 2]: 1 hit; 3 evicts 2; 2 evicts 1; 1 evicts 3; 3 evicts 2.
    assert replay(LRU, train, test, 2).hits == 1
    assert replay(LRU, np.zeros(0, np.int64), test, 2).hits == 0


class _Spy(LRU):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def on_insert(self, digest: str, size: int, count: int = 0) -> None:
        self.calls.append(("insert", int(digest)))
        super().on_insert(digest, size, count)

    def on_access(self, digest: str) -> None:
        self.calls.append(("access", int(digest)))
        super().on_access(digest)

    def on_remove(self, digest: str) -> None:
        self.calls.append(("remove", int(digest)))
        super().on_remove(digest)


def test_replay_drives_the_policy_as_the_store_does() -> None:
    spies: list[_Spy] = []

    def make() -> _Spy:
        spies.append(_Spy())
        return spies[-1]

    replay(make, np.zeros(0, np.int64), np.array([1, 2, 1, 3], dtype=np.int64), 2)
    assert spies[0].calls == [
        ("insert", 1), ("access", 1),  # a miss: the daemon inserts, then counts the use
        ("insert", 2), ("access", 2),
        ("access", 1),  # a hit
        ("remove", 2), ("insert", 3), ("access", 3),  # room first, then the new entry
    ]  # fmt: skip
    spies.clear()
    replay(make, np.zeros(0, np.int64), np.array([1], dtype=np.int64), 2, daemon_touch=False)
    assert spies[0].calls == [("insert", 1)]


def test_lfu_never_ages() -> None:
    p = LFU()
    for d in "ab":
        p.on_insert(d, 1)
    for _ in range(3):
        p.on_access("a")
    assert p.victims(1, set()) == ["b"]
    p.on_remove("b")
    p.on_insert("c", 1)
    assert p.victims(1, set()) == ["c"] and p._age == 0.0


def test_stream_views_and_cut() -> None:
    calls = [np.array([5, 6, 5, 7]), np.array([1 * KEY_STRIDE + 2]), np.array([5, 5, 8])]
    s = Stream.of_calls(calls)
    assert s.starts.tolist() == [0, 4, 5]
    c = s.per_call()
    assert c.keys.tolist() == [5, 6, 7, KEY_STRIDE + 2, 5, 8]
    assert c.starts.tolist() == [0, 3, 4]
    head, tail = s.cut(0.5)  # 4 of 8 requests: the cut falls on the second call's start
    assert head.keys.tolist() == [5, 6, 5, 7] and tail.starts.tolist() == [0, 1]
    head, tail = s.cut(0.3)  # inside the first call: moves to its end
    assert head.keys.size == 4


def test_read_requests_keeps_the_recorded_order(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(path, model="m")
    rec(1, np.array([[3, 1], [3, 2]]))  # a prefill of two tokens on layer 1
    rec(2, np.array([[0, 4], [5, 4]]))
    rec(1, np.array([[7, 3]]))  # the next step
    rec.close()
    s = read_requests(path)
    layer1, layer2 = KEY_STRIDE, 2 * KEY_STRIDE
    assert s.keys.tolist() == [layer1 + 3, layer1 + 1, layer1 + 3, layer1 + 2,
                               layer2, layer2 + 4, layer2 + 5, layer2 + 4,
                               layer1 + 7, layer1 + 3]  # fmt: skip
    assert s.starts.tolist() == [0, 4, 8]
    assert s.per_call().keys.size == 3 + 3 + 2


def test_synthetic_shape_determinism_and_skew() -> None:
    spec = SynthSpec(layers=4, experts=32, top_k=3, tokens=300, drift_every=100, seq_len=(20, 60))
    a, b = synthetic(spec), synthetic(spec)
    assert np.array_equal(a.test.keys, b.test.keys) and np.array_equal(a.train.keys, b.train.keys)
    keys = np.concatenate([a.train.keys, a.test.keys])
    assert keys.size == 300 * 4 * 3
    assert set(np.unique(keys // KEY_STRIDE).tolist()) == {0, 1, 2, 3}
    assert int((keys % KEY_STRIDE).max()) < 32
    # Every call holds one layer; a decode call is one token: its experts are distinct.
    starts = np.append(np.concatenate([a.train.starts, a.test.starts + a.train.keys.size]),
                       keys.size)  # fmt: skip
    for lo, hi in itertools.pairwise(starts.tolist()):
        assert np.unique(keys[lo:hi] // KEY_STRIDE).size == 1
        if hi - lo == 3:
            assert np.unique(keys[lo:hi]).size == 3
    share, uniform = routing_skew(a.test.keys, 32)
    assert share > 1.5 * uniform
    assert not np.array_equal(synthetic(SynthSpec(**{**spec.__dict__, "seed": 1})).test.keys,
                              a.test.keys)  # fmt: skip


def test_a0_evicts_the_least_frequent_of_the_scored_part() -> None:
    # Frequencies 1:3, 2:2, 3:1. Cold, capacity 2: 1 m, 2 m, 1 h, 3 m (drops 2), 1 h, 2 m.
    test = np.array([1, 2, 1, 3, 1, 2], dtype=np.int64)
    assert a0_hits(np.zeros(0, np.int64), test, 2).hits == 2
    # Warm-up requests fill the cache but are not scored.
    assert a0_hits(np.array([1, 2], dtype=np.int64), test, 2).hits == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=40), st.integers(1, 4))
def test_a0_never_beats_belady(seq: list[int], cap: int) -> None:
    keys = np.array(seq, dtype=np.int64)
    assert a0_hits(keys[::-1].copy(), keys, cap).hits <= belady_hits(keys, cap).hits


def test_now_evicts_the_least_likely_under_the_present_distribution() -> None:
    # One layer of 3 experts, two states: first expert 0 is likeliest, then expert 2.
    dists = np.array([[[0.6, 0.3, 0.1]], [[0.1, 0.3, 0.6]]])
    keys = np.array([0, 1, 2, 0, 2, 1], dtype=np.int64)
    # State 0 throughout, capacity 2: 0 m, 1 m, 2 m (drops 2 itself? no: drops the least
    # likely CACHED one, 1), 0 h, 2 h, 1 m.
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int32))
    assert now_hits(empty, (keys, np.zeros(6, np.int32)), 2, dists, KEY_STRIDE).hits == 2
    # In state 1 from the third request on, 0 is the least likely when 2 arrives: 0 m, 1 m,
    # 2 m (drops 0), 0 m (drops 1), 2 h, 1 m.
    states = np.array([0, 0, 1, 1, 1, 1], dtype=np.int32)
    assert now_hits(empty, (keys, states), 2, dists, KEY_STRIDE).hits == 1
    # Warm-up requests fill the cache but are not scored; keys of layer 1 map to row 1.
    two = np.array([[[0.5, 0.5], [0.9, 0.1]]])
    layer1 = np.array([KEY_STRIDE, KEY_STRIDE + 1, KEY_STRIDE], dtype=np.int64)
    warm = (np.array([KEY_STRIDE], dtype=np.int64), np.zeros(1, np.int32))
    assert now_hits(warm, (layer1, np.zeros(3, np.int32)), 1, two, KEY_STRIDE).hits == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.integers(1, 4), st.integers(0, 9))
def test_now_never_beats_belady(seq: list[int], cap: int, seed: int) -> None:
    keys = np.array(seq, dtype=np.int64)
    rng = np.random.default_rng(seed)
    dists = rng.dirichlet(np.ones(6), size=(3, 1))
    states = rng.integers(0, 3, size=keys.size).astype(np.int32)
    warm = (keys[::-1].copy(), states[::-1].copy())
    assert (
        now_hits(warm, (keys, states), cap, dists, KEY_STRIDE).hits <= belady_hits(keys, cap).hits
    )


def test_belady_mask_marks_each_hit() -> None:
    # Capacity 1 from the best start: 1 is loaded, 1 h, 2 m, 2 h, 1 m, 1 h.
    hit = belady_mask(np.array([1, 1, 2, 2, 1, 1], dtype=np.int64), 1)
    assert hit.tolist() == [True, True, False, True, False, True]


def test_first_in_call_and_states_follow_the_views() -> None:
    s = Stream(np.array([5, 6, 5, 6, 7, 7], dtype=np.int64), np.array([0, 4]),
               np.array([0, 0, 0, 1, 2, 3], dtype=np.int32))  # fmt: skip
    assert s.first_in_call().tolist() == [True, True, False, False, True, False]
    c = s.per_call()
    assert c.keys.tolist() == [5, 6, 7] and c.states is not None
    assert c.states.tolist() == [0, 0, 2]
    head, tail = s.cut(0.5)
    assert head.states is not None and tail.states is not None
    assert head.states.tolist() == [0, 0, 0, 1] and tail.states.tolist() == [2, 3]


def test_synthetic_states_index_the_distribution_each_request_was_drawn_from() -> None:
    split = synthetic(SynthSpec(layers=3, experts=32, top_k=4, tokens=600, seed=2))
    assert split.dists is not None and split.test.states is not None
    assert split.dists.shape[1:] == (3, 32)
    assert np.allclose(split.dists.sum(axis=2), 1.0)
    # Requests land mostly on what their own state makes likely: the favoured experts of the
    # sequence are boosted, so the drawn experts' mean probability beats a random state's.
    keys, states = split.test.keys, split.test.states
    own = split.dists[states, keys // KEY_STRIDE, keys % KEY_STRIDE].mean()
    other = split.dists[(states + 1) % len(split.dists), keys // KEY_STRIDE, keys % KEY_STRIDE]
    assert own > 1.1 * other.mean()  # 0.090 against 0.079 (seed 2)


def test_ceiling_of_a_token_row_comes_from_its_call_row() -> None:
    from traces import Split

    token = Stream(np.array([1, 1, 1, 2], dtype=np.int64), np.array([0, 3]))
    call = token.per_call()
    splits = {"t": Split("t", token, token, 4), "t/call": Split("t/call", call, call, 4)}

    def row(name: str, distinct: bool, **rates: float) -> policy_eval.Row:
        base = {"now*": float("nan"), "A0*": 0.0, "Belady~": 0.0, "Belady": 0.0}
        return policy_eval.Row(name, 10, {**base, **rates}, distinct)

    # The call row is order-free (Belady~ >= Belady): its ceiling is A0*.
    c = row("t/call", True, **{"A0*": 0.5, "Belady": 1.0, "Belady~": 1.0})
    # Token row: Belady hits 3 of 4, 1 of them on a call's first request (2 of 4 are firsts).
    t = row("t", False, Belady=0.75, **{"Belady@first": 0.25})
    other = row("u", False, Belady=0.5, **{"Belady@first": 0.25})  # no call row: no ceiling
    policy_eval.online_ceiling([t, c, other], splits)
    assert c.rates["ceiling"] == 0.5
    # Belady's 2 hits on repeats, and on firsts min(0.5 x 2 of the 4 requests, Belady's 1).
    assert t.rates["ceiling"] == pytest.approx(0.75) and t.ceiling == pytest.approx(1.0)
    assert np.isnan(other.rates["ceiling"])


def test_shuffled_keeps_each_layers_calls_and_their_places() -> None:
    src = synthetic(SynthSpec(layers=3, experts=32, top_k=4, tokens=600, seed=2)).test
    got = src.shuffled(np.random.default_rng(0))
    assert got.keys.size == src.keys.size and not np.array_equal(got.keys, src.keys)

    def calls(s: Stream) -> list[np.ndarray]:
        return np.split(s.keys, s.starts[1:])

    before, after = calls(src), calls(got)
    assert [int(c[0] // KEY_STRIDE) for c in before] == [int(c[0] // KEY_STRIDE) for c in after]
    assert sorted(c.tobytes() for c in before) == sorted(c.tobytes() for c in after)


def test_a_row_is_order_free_only_with_distinct_calls_and_nothing_lost_to_a_shuffle() -> None:
    rates = {"Belady": 0.30, "Belady~": 0.31, "A0*": 0.14}
    assert policy_eval.Row("t/call", 10, rates, distinct_calls=True).order_free
    assert not policy_eval.Row("t", 10, rates, distinct_calls=False).order_free
    lower = {**rates, "Belady~": 0.29}
    assert not policy_eval.Row("t/call", 10, lower, distinct_calls=True).order_free


def test_fixed_best_is_the_top_counts() -> None:
    test = np.array([1, 1, 1, 2, 2, 3], dtype=np.int64)
    assert policy_eval.fixed_best(test, 1) == pytest.approx(3 / 6)
    assert policy_eval.fixed_best(test, 2) == pytest.approx(5 / 6)


# ---- the default policy ---------------------------------------------------------------


def _rate(make: object, keys: list[int], cap: int) -> float:
    arr = np.array(keys, dtype=np.int64)
    return replay(make, np.zeros(0, np.int64), arr, cap).rate  # type: ignore[arg-type]


def test_default_is_the_window_lfu() -> None:
    assert isinstance(make_policy("default"), WindowLFU)
    assert make_policy("wlfu").name == "wlfu"


def test_window_lfu_victims_respect_pins_and_do_not_mutate() -> None:
    p = WindowLFU()
    for d in "abcdef":
        p.on_insert(d, 10)
        p.on_access(d)
    for _ in range(3):
        p.on_access("b")
    first = p.victims(25, {"a"})
    assert "a" not in first and len(first) == 3
    assert p.victims(25, {"a"}) == first
    assert len(p) == 6
    assert sorted(p.victims(1000, set())) == list("abcdef")
    assert p.victims(1000, set("abcdef")) == []


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "access", "remove", "evict"]),
            st.integers(0, 11),
            st.integers(1, 3),
        ),
        max_size=120,
    ),  # fmt: skip
    st.frozensets(st.integers(0, 11), max_size=3),
)
def test_window_lfu_keeps_the_protocol(
    ops: list[tuple[str, int, int]], pins: frozenset[int]
) -> None:
    p = WindowLFU()
    sizes: dict[str, int] = {}
    pinned = {str(i) for i in pins}
    for op, i, n in ops:
        d = str(i)
        if op == "insert" and d not in sizes:
            p.on_insert(d, n, count=i % 2)
            sizes[d] = n
        elif op == "access":
            p.on_access(d)  # a digest it does not hold is ignored
        elif op == "remove" and d in sizes:
            p.on_remove(d)
            del sizes[d]
        elif op == "evict":
            need = n * 2
            out = p.victims(need, pinned)
            assert out == p.victims(need, pinned)  # asking twice: the same answer
            assert len(set(out)) == len(out) and set(out) <= set(sizes) - pinned
            eligible = sum(s for d2, s in sizes.items() if d2 not in pinned)
            assert sum(sizes[v] for v in out) >= min(need, eligible)
            for v in out:
                p.on_remove(v)
                del sizes[v]
        assert len(p) == len(sizes)


def test_window_lfu_keeps_a_hot_set_through_cyclic_scans() -> None:
    # Each "token" uses 4 hot experts and a sweep of 30 one-off ones: LRU loses the hot set
    # every token (the sweep is longer than the cache), a frequency policy keeps it.
    keys = [k for t in range(200) for k in [*range(4), *range(100 + 30 * t, 130 + 30 * t)]]
    assert _rate(WindowLFU, keys, 10) > 0.1 > _rate(LRU, keys, 10)


def test_window_lfu_grows_its_window_when_recency_pays() -> None:
    # Bursts: a fresh set of 8 experts reused 20 times, then never again. Only recency helps;
    # the window must grow to hold the burst.
    keys = [1000 * b + i for b in range(60) for _ in range(20) for i in range(8)]
    p = WindowLFU()
    replay(lambda: p, np.zeros(0, np.int64), np.array(keys, dtype=np.int64), 10)
    assert p._window_cap() >= 8
    assert _rate(WindowLFU, keys, 10) >= 0.9 * _rate(LRU, keys, 10)


def test_window_lfu_remembers_counts_of_evicted_experts() -> None:
    def first_victim(history: int) -> str:
        p = WindowLFU()
        p.on_insert("hot", 1)
        for _ in range(history):
            p.on_access("hot")
        p.on_remove("hot")
        for d in ("x", "hot", "y"):
            p.on_insert(d, 1)
            p.on_access(d)
        return p.victims(1, set())[0]

    # Back with its history, "hot" out-counts the once-used "x"; without it, it goes first.
    assert first_victim(5) == "x"
    assert first_victim(0) == "hot"


# ---- the bench end to end ---------------------------------------------------------------


def test_policy_eval_runs_tiny(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = policy_eval.main(["--dir", str(tmp_path), "--tokens", "120", "--prompts", "1",
                           "--max-new", "1", "--jobs", "1", "--markdown", "--also", "lfuda"])  # fmt: skip
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and re.fullmatch(r"ratio=\d+\.\d{3}", out[-1])
    rows = [line for line in out if line.startswith("| engine-5x32k4/call | 10 |")]
    assert len(rows) == 1 and len(rows[0].strip("|").split("|")) == 15  # 14 columns + lfuda
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    belady, a0, shuffled = float(cells[5]), float(cells[9]), float(cells[11])
    assert 0.0 <= a0 <= belady and 0.0 <= shuffled <= 1.0
    assert cells[12] == "-"  # now* needs a generator's distributions
    synth = [line for line in out if line.startswith("| synth-k3/call | 10 |")]
    cells = [c.strip() for c in synth[0].strip("|").split("|")]
    now, ceiling = float(cells[12]), float(cells[13])
    assert 0.0 <= now <= float(cells[5]) and 0.0 <= ceiling <= 1.0
    assert any(line.startswith("| trace |") and line.endswith("| lfuda |") for line in out)
    assert list(tmp_path.iterdir()) == [], "the work dir must be removed"
    worst = float(out[-1].split("=")[1])
    assert 0.0 <= worst <= 1.0
