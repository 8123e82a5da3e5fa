"""Replay a request stream through an eviction policy, or through Belady's MIN, and count hits.

The replay drives a policy exactly as the daemon's store does (``cachecd.budget.Ledger``):
- a hit calls ``on_access``;
- a miss asks ``victims`` for room when the cache is full (the new expert is not in the policy
  yet), calls ``on_remove`` for each victim, then ``on_insert``; the daemon then opens the
  fresh blob and counts that as an access, so a miss also calls ``on_access`` (``--no-daemon-touch``
  in policy_eval turns that off).
Every expert of a model has the same size, so sizes are 1 and the capacity is a count.

Invariants:
- Only test requests are scored; train requests warm the policy and the cache first.
- ``belady_hits`` is an upper bound for every policy on the same test requests, however it was
  warmed: MIN (evict the entry used farthest in the future) from the best possible starting
  content, which is cold MIN plus its first ``min(capacity, distinct)`` misses as hits.
- ``a0_hits`` knows how often each key occurs in the scored part but not when: it evicts the
  cached key that occurs least. When requests are independent draws from fixed frequencies
  (the independent reference model), that is the best any demand-paging policy can do without
  seeing the future (the classical A0 result), so A0 on such a trace is an online ceiling.
- ``now_hits`` (synthetic traces) knows the distribution each request is drawn from, at the
  time it is drawn, but not the draws: it evicts the cached key least likely to be picked next
  under the present distribution. That is A0 for a distribution that changes (topic drift, a
  new sequence's favoured experts), told every change the moment it happens, which no policy
  is: about the most an online policy can expect on such a trace.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cachecd.store.policies import LFUDA, EvictionPolicy

NO_PINS: frozenset[int] = frozenset()


class LFU(LFUDA):
    """Plain LFU (the baseline): LFUDA with the aging term held at 0."""

    name = "lfu"

    def victims(self, n_bytes: int, exclude: object) -> list:  # type: ignore[override]
        out = super().victims(n_bytes, exclude)  # type: ignore[arg-type]
        self._age = 0.0
        return out


@dataclass(frozen=True)
class Score:
    hits: int
    requests: int

    @property
    def rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


def replay(
    make: Callable[[], EvictionPolicy],
    train: np.ndarray,
    test: np.ndarray,
    capacity: int,
    daemon_touch: bool = True,
) -> Score:
    policy = make()
    resident: set[int] = set()
    _run(policy, resident, train.tolist(), capacity, daemon_touch)
    hits = _run(policy, resident, test.tolist(), capacity, daemon_touch)
    return Score(hits, int(test.size))


def _run(
    policy: EvictionPolicy, resident: set[int], keys: list[int], capacity: int, daemon_touch: bool
) -> int:
    hits = 0
    # Bound methods hoisted: this loop runs millions of times.
    access, insert, remove, victims = (
        policy.on_access,
        policy.on_insert,
        policy.on_remove,
        policy.victims,
    )
    for k in keys:
        if k in resident:
            access(k)  # type: ignore[arg-type]
            hits += 1
            continue
        if len(resident) >= capacity:
            for v in victims(1, NO_PINS):  # type: ignore[arg-type]
                remove(v)
                resident.discard(v)  # type: ignore[arg-type]
        insert(k, 1)  # type: ignore[arg-type]
        resident.add(k)
        if daemon_touch:
            access(k)  # type: ignore[arg-type]
    return hits


def next_use(keys: np.ndarray) -> np.ndarray:
    """For each position, the next position holding the same key, or ``len(keys)`` if none."""
    n = keys.size
    order = np.argsort(keys, kind="stable")
    nxt = np.full(n, n, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_hits(test: np.ndarray, capacity: int) -> Score:
    """MIN's hits on ``test`` from the best starting content (see the module docstring)."""
    return Score(int(belady_mask(test, capacity).sum()), int(test.size))


def belady_mask(test: np.ndarray, capacity: int) -> np.ndarray:
    """Which requests of ``test`` MIN hits, from the best starting content."""
    nxt = next_use(test).tolist()
    cached: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key); stale rows skipped
    hit = np.zeros(test.size, dtype=bool)
    for i, k in enumerate(test.tolist()):
        nu = nxt[i]
        if k in cached:
            hit[i] = True
        elif len(cached) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
                    break
        cached[k] = nu
        heapq.heappush(heap, (-nu, k))
    # The best starting content: the first min(capacity, distinct) keys that cold MIN missed
    # on their first request are loaded already (a key's first request is its first in a call).
    _, first = np.unique(test, return_index=True)
    hit[np.sort(first)[:capacity]] = True
    return hit


def now_hits(
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    capacity: int,
    dists: np.ndarray,
    key_stride: int,
) -> Score:
    """A0 under the present distribution: ``train`` and ``test`` are (keys, states) and
    ``dists[state, layer, expert]`` the probability of each expert in that state."""
    n_states, _, per_layer = dists.shape
    flat = dists.reshape(n_states, -1)
    slot: dict[int, int] = {}  # dense key -> its place in ``held``
    held = np.zeros(capacity, dtype=np.int64)  # the cached dense keys
    hits = 0
    for (keys, states), scored in ((train, False), (test, True)):
        dense = (keys // key_stride) * per_layer + keys % key_stride
        for k, state in zip(dense.tolist(), states.tolist(), strict=True):
            if k in slot:
                hits += scored
                continue
            if len(slot) < capacity:
                i = len(slot)
            else:
                i = int(np.argmin(flat[state][held]))
                del slot[int(held[i])]
            held[i] = k
            slot[k] = i
    return Score(hits, int(test[0].size))


def a0_hits(train: np.ndarray, test: np.ndarray, capacity: int) -> Score:
    """A0 with the scored part's own frequencies: warmed on ``train``, scored on ``test``."""
    keys, counts = np.unique(test, return_counts=True)
    freq = dict(zip(keys.tolist(), counts.tolist(), strict=True))
    cached: set[int] = set()
    heap: list[tuple[int, int]] = []  # (frequency, key): a key's priority never changes
    hits = 0
    for part, scored in ((train, False), (test, True)):
        for k in part.tolist():
            if k in cached:
                hits += scored
                continue
            if len(cached) >= capacity:
                cached.discard(heapq.heappop(heap)[1])
            cached.add(k)
            heapq.heappush(heap, (freq.get(k, 0), k))
    return Score(hits, int(test.size))
