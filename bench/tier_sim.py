"""The engine's RAM tier on a routing trace: what it is asked, a replay through a policy, and
the optimum for the same requests.

This replays the tier as it was until 2026-12-04, beside the stack buffers: admission optional,
a miss read into a stack buffer whether or not the tier keeps it. The engine now keeps one pool
of slots (``cachecd_engine.pool.slots.SlotTable``) where every miss needs a slot, so the pool admits
by use counts (scratch slots for the rest); its replay is ``tests/unit/test_pool.py``'s
``_replay``. The policy rankings here still rank the policy that orders the pool's kept part.

What the tier is asked (``ExpertBank.run`` and ``_run_groups`` in engine/streamed_moe.py): a
layer call takes ``np.unique(routed)``, so the tier sees each DISTINCT expert of a call once (the
per-call view, ``Stream.per_call``); a prefill row that repeats an expert never reaches it. Inside
a call the experts go in ascending id order, and all of them are looked up (``RamTier.lookup``: a
hit calls ``on_access``) BEFORE any miss is admitted (``RamTier.admit``, after the kernel has its
stack: ``victims`` for the room, ``on_remove`` for each, ``on_insert``, ``on_access``). A call over
more experts than one stack buffer holds runs in groups of that many, each looked up and then
admitted before the next. A *batch* here is one group of one call: distinct experts of one layer,
ascending, looked up together, then admitted. (With read-ahead, a decode call puts the guessed
experts first: the same batch in another order, which only reorders recency inside it.)

Invariants:
- ``replay_batches`` drives a policy with exactly ``RamTier``'s call sequence; sizes are 1 (all
  experts of a model have one size), so the capacity is a count of experts.
- ``belady_batches`` is an upper bound for every policy on the same scored batches, however it
  was warmed: after each batch it keeps the ``capacity`` experts of (held + batch) whose next use
  comes first, admission optional (farthest-in-future with bypass; Belady's exchange argument
  holds with batches as requests), from the best starting content (the ``capacity`` experts used
  first). MIN on the per-call stream in a fixed order is NOT a bound here: looking a batch up
  before admitting keeps hits that an in-order MIN evicts for an earlier miss of the same call.
  The tier cannot skip an admission, but a policy can evict the newcomer next, so it is at most
  one slot behind a tier that can.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np
from policy_sim import Score, next_use
from traces import KEY_STRIDE, Stream

from cachecd.store.policies import EvictionPolicy


def engine_view(stream: Stream, group: int | None = None) -> Stream:
    """The batches the tier is asked: each call's distinct experts in ascending order, cut into
    groups of at most ``group`` (the experts one stack buffer holds)."""
    calls = stream.per_call()
    n = calls.keys.size
    if n == 0:
        return calls
    order = np.lexsort((calls.keys, calls.call_of()))
    sizes = np.diff(np.append(calls.starts, n))
    if group is not None and int(sizes.max()) > group:
        sizes = np.array(
            [g for m in sizes.tolist() for g in [group] * (m // group) + [m % group] if g],
            dtype=np.int64,
        )
    return Stream.of_sizes(calls.keys[order], sizes)


def with_reuse(stream: Stream, top_k: int, p: float, seed: int) -> Stream:
    """Token-to-token reuse that the synthetic generator lacks (its tokens are independent draws
    within a sequence): in a decode call (``top_k`` requests of one token), each expert the same
    layer's previous decode call routed to is routed again with probability ``p``; the call's own
    draws fill the rest, in order. A prefill call starts a layer afresh."""
    rng = np.random.default_rng(seed)
    keys = stream.keys.copy()
    bounds = [*stream.starts.tolist(), keys.size]
    prev: dict[int, list[int]] = {}
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        layer = int(keys[a]) // KEY_STRIDE
        if b - a != top_k:
            prev.pop(layer, None)
            continue
        kept = [k for k in prev.get(layer, []) if rng.random() < p]
        fresh = [k for k in keys[a:b].tolist() if k not in kept][: top_k - len(kept)]
        keys[a:b] = kept + fresh
        prev[layer] = keys[a:b].tolist()
    return Stream(keys, stream.starts)


def decode_reuse(stream: Stream, top_k: int) -> float:
    """Share of a decode call's experts that the same layer's previous token also routed to."""
    keys = stream.keys.tolist()
    bounds = [*stream.starts.tolist(), len(keys)]
    prev: dict[int, set[int]] = {}
    shared = calls = 0
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        layer = keys[a] // KEY_STRIDE
        if b - a != top_k:
            prev.pop(layer, None)
            continue
        cur = set(keys[a:b])
        if layer in prev:
            shared += len(cur & prev[layer])
            calls += 1
        prev[layer] = cur
    return shared / (calls * top_k) if calls else 0.0


def replay_batches(
    make: Callable[[], EvictionPolicy], train: Stream, test: Stream, capacity: int
) -> Score:
    """Hits on the batches of ``test`` after warming on ``train``, driven as ``RamTier`` is."""
    policy = make()
    resident: set[int] = set()
    _run(policy, resident, train, capacity)
    return Score(_run(policy, resident, test, capacity), int(test.keys.size))


def _run(policy: EvictionPolicy, resident: set[int], s: Stream, capacity: int) -> int:
    # Bound methods hoisted: this loop runs millions of times.
    access, insert, remove, victims = (
        policy.on_access,
        policy.on_insert,
        policy.on_remove,
        policy.victims,
    )
    keys = s.keys.tolist()
    bounds = [*s.starts.tolist(), len(keys)]
    hits = 0
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        misses = []
        for k in keys[a:b]:  # RamTier.lookup: the whole batch first
            if k in resident:
                access(k)  # type: ignore[arg-type]
                hits += 1
            else:
                misses.append(k)
        for k in misses:  # then RamTier.admit for each expert read from the daemon
            if len(resident) >= capacity:
                for v in victims(1, ()):
                    remove(v)
                    resident.discard(v)  # type: ignore[arg-type]
                if len(resident) >= capacity:
                    continue
            insert(k, 1)  # type: ignore[arg-type]
            resident.add(k)
            access(k)  # type: ignore[arg-type]
    return hits


def belady_batches(test: Stream, capacity: int) -> Score:
    """The optimum on the batches of ``test`` (see the module docstring)."""
    ks = test.keys.tolist()
    nxt = next_use(test.keys).tolist()
    held: dict[int, int] = {}  # key -> its next use
    _, first = np.unique(test.keys, return_index=True)
    for pos in np.sort(first)[:capacity].tolist():  # the best starting content
        held[ks[pos]] = pos
    heap = [(-pos, k) for k, pos in held.items()]  # (-next use, key); stale rows skipped
    heapq.heapify(heap)
    hits = 0
    bounds = [*test.starts.tolist(), len(ks)]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        for i in range(a, b):
            k = ks[i]
            hits += k in held
            held[k] = nxt[i]
            heapq.heappush(heap, (-nxt[i], k))
        while len(held) > capacity:
            neg, k = heapq.heappop(heap)
            if held.get(k) == -neg:
                del held[k]
    return Score(hits, len(ks))
