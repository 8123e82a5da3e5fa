"""A workload's calls through the engine's pool of slots and then the daemon's disk budget,
with their own code: ``cachecd_engine.pool.slots.SlotTable`` (the pool's policy and admission) and
``cachecd.store.policies`` (the store's eviction), driven as the engine and the store drive
them.

- The pool sees every call as the bank makes it (``ExpertBank.run``, ``calls.run_groups``,
  ``Filler.acquire``): the call's distinct experts in the bank's order (ascending), ``use``
  (hits), then ``claim`` of the misses with the call's held slots kept (slots that queued work
  reads are taken last), then ``filled``. A call over more experts than the pool holds goes in
  groups of half the pool, the held experts first, each group's slots read by its queued work
  (fenced) until the next layer's routing read-back. The order matters: which expert takes a
  slot, and whether it joins the kept part, depends on the order of the claims. The table runs
  the engine's default policy (``cycle``: the layer cycle), which learns from these calls as it
  does in the engine. The router's forecast (``SlotTable.forecast``) is not in recorded traces;
  without read-ahead (the engine's default) it changes the pool's hits by 0.002 at most
  (bench/pool_policy.py, cycle with and without it).
- The disk sees only the pool's misses (the engine asks the daemon for nothing else), as the
  store does: the call's experts held from eviction, a hit is an ``on_access``, a miss reserves
  its bytes (the policy's victims are removed), is inserted and then counted as used.
- A run: the disk cache outlives a run, the pool does not (each ``cachecd run`` starts with an
  empty one). So the disk is warmed first: a trace replayed ``passes - 1`` times; under flat
  routing every expert asked once in a random order (the disk then holds a random set as large
  as its budget) and ``warm_tokens`` tokens. Then the counted calls (the trace's last pass, or
  the workload's tokens) start from an EMPTY pool, as a run does: every expert a run uses is
  read once into its pool, from the disk where the budget held it, else from the Hub. Under
  flat routing a pool of C of N experts, once full, hits about C/N of the time: the next
  token's experts do not depend on what is cached (a pool of a few tokens' worth hits less:
  when a layer is called its own experts are the ones used longest ago).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cachecd.manifest.manifest import Manifest
from cachecd.plan.routing import Call, Workload
from cachecd.store.policies import EvictionPolicy, make_policy

Key = tuple[int, int]


@dataclass
class Counted:
    """What the counted calls asked, in experts and bytes, and where it came from."""

    tokens: int = 0
    calls: int = 0  # decode layer calls
    miss_calls: int = 0  # daemon requests they make: one per call (or group) with a pool miss
    asked: int = 0
    asked_bytes: int = 0
    pool_hits: int = 0
    pool_hit_bytes: int = 0
    disk_hits: int = 0
    disk_hit_bytes: int = 0
    hub_bytes: int = 0

    @property
    def pool_hit_rate(self) -> float:
        return self.pool_hits / self.asked if self.asked else 0.0

    @property
    def disk_hit_rate(self) -> float:
        """Of the pool's misses, the share the disk cache held."""
        missed = self.asked - self.pool_hits
        return self.disk_hits / missed if missed else 1.0

    def per_token(self, n: int) -> float:
        return n / self.tokens if self.tokens else 0.0


class DiskSim:
    """The store's budget and eviction policy, without the bytes."""

    def __init__(self, budget: int, policy: str = "default") -> None:
        self.budget = budget
        self.used = 0
        self.policy: EvictionPolicy = make_policy(policy)
        self.sizes: dict[str, int] = {}

    def request(self, layer: int, ids: list[int], size_of: dict[Key, int]) -> list[bool]:
        """Whether each expert was a hit; misses are fetched and committed (if they fit)."""
        names = [f"{layer}:{e}" for e in ids]
        held = set(names)
        hits = []
        for name, e in zip(names, ids, strict=True):
            if name in self.sizes:
                self.policy.on_access(name)
                hits.append(True)
                continue
            hits.append(False)
            size = size_of[(layer, e)]
            need = self.used + size - self.budget
            if need > 0:
                for victim in self.policy.victims(need, held):
                    self.used -= self.sizes.pop(victim)
                    self.policy.on_remove(victim)
            if self.used + size <= self.budget:
                self.sizes[name] = size
                self.used += size
                self.policy.on_insert(name, size)
                self.policy.on_access(name)
        return hits


def slot_bytes(manifest: Manifest) -> int:
    """One slot's memory, by the pool's rule (``PoolMemory.slot_nbytes``)."""
    from cachecd_engine.formats import StackLayout, quant_spec
    from cachecd_engine.pool.arrays import PoolMemory

    layout = StackLayout.of(manifest.expert(manifest.moe_layers[0], 0))
    return PoolMemory.slot_nbytes(quant_spec(manifest.quant_format), layout)


def pool_slots(pool_bytes: int, slot_bytes: int, top_k: int, experts: int) -> int:
    """The slots a default-sized pool of ``pool_bytes`` has, by the bank's and the loader's
    rule (``ExpertBank._slots_for``): at least two decode calls' worth, at most the experts the
    model has (more would stay empty)."""
    from cachecd_engine.pool.bank import MIN_SLOTS

    return min(max(MIN_SLOTS, 2 * top_k, pool_bytes // slot_bytes), experts)


def replay(manifest: Manifest, work: Workload, slots: int, budget: int, passes: int = 2,
           seed: int = 0, warm_tokens: int = 2) -> Counted:
    """The workload through a pool of ``slots`` and a disk budget of ``budget`` bytes; the
    counts of its last pass (traces) or of its tokens after the disk's warm-up (flat routing),
    each from an empty pool."""
    from cachecd_engine.pool.slots import SlotTable

    size_of = _sizes(manifest)
    table = SlotTable(slots, experts_per_layer=manifest.experts_per_layer)
    disk = DiskSim(budget)
    if work.source.startswith("flat"):
        calls = _every_expert(manifest, seed) + _flat_tokens(manifest, work.top_k, warm_tokens,
                                                              seed) + work.calls
        counted_from = len(calls) - len(work.calls)
    else:
        calls = work.calls * passes
        counted_from = len(work.calls) * (passes - 1)
    out = Counted(tokens=work.tokens)
    for i, (layer, ids, decode) in enumerate(calls):
        if i == counted_from:  # a run starts: its pool is empty, the disk is as it was left
            table = SlotTable(slots)
        requests, hits = through_pool(table, layer, ids)
        missed = [e for r in requests for e in r]
        disk_hits = [h for r in requests for h in disk.request(layer, r, size_of)]
        if i < counted_from or not decode:
            continue
        out.calls += 1
        out.miss_calls += len(requests)
        out.asked += len(ids)
        out.asked_bytes += sum(size_of[(layer, e)] for e in ids)
        out.pool_hits += len(hits)
        out.pool_hit_bytes += sum(size_of[(layer, e)] for e in hits)
        for e, hit in zip(missed, disk_hits, strict=True):
            if hit:
                out.disk_hits += 1
                out.disk_hit_bytes += size_of[(layer, e)]
            else:
                out.hub_bytes += size_of[(layer, e)]
    return out


QUEUED = object()  # the output a call's queued work computes, as the bank's fences hold it


def through_pool(table: Any, layer: int, ids: list[int]) -> tuple[list[list[int]], list[int]]:
    """One layer call as the bank makes it (see the module docstring): (the experts of each
    request it makes of the daemon, one per group with a miss, in the order asked; the experts
    the pool held)."""
    # The call's routing read-back evaluated every queued reader of a slot (all fenced QUEUED).
    table.clear_fences([QUEUED])
    ids = sorted(set(ids))  # calls.distinct
    if len(ids) <= table.capacity:
        groups = [ids]
    else:  # calls.run_groups: half the pool a group, the experts held first
        size = max(1, table.capacity // 2)
        order = sorted(ids, key=lambda e: (layer, e) not in table)
        groups = [order[i:i + size] for i in range(0, len(order), size)]
    requests: list[list[int]] = []
    hits: list[int] = []
    for group in groups:
        held, claimed = _acquire(table, layer, group)
        hits += held
        if claimed:
            requests.append(list(claimed))
        table.fence([*held.values(), *claimed.values()], QUEUED)  # its queued work reads them
    return requests, hits


def _acquire(table: Any, layer: int, ids: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """``Filler.acquire``'s moves on the table: (held expert -> slot, claimed expert -> slot)."""
    held = table.use(layer, ids)
    keep = set(held.values())
    todo = [e for e in ids if e not in held]
    claimed = table.claim(layer, todo, keep, take_fenced=False, use=True).slots
    rest = [e for e in todo if e not in claimed]
    if rest:  # Filler._claim: then slots that queued work reads (evaluated first)
        claimed.update(table.claim(layer, rest, keep, use=True).slots)
    table.filled(claimed.values())
    return held, claimed


def _sizes(manifest: Manifest) -> dict[Key, int]:
    return dict(zip(zip(manifest.layer_ids.tolist(), manifest.expert_ids.tolist(), strict=True),
                    manifest.sizes.tolist(), strict=True))


def _every_expert(manifest: Manifest, seed: int) -> list[Call]:
    """One call per expert, every expert once, in a random order."""
    rows = np.random.default_rng(seed + 1).permutation(manifest.n_experts)
    layers, experts = manifest.layer_ids[rows].tolist(), manifest.expert_ids[rows].tolist()
    return [(layer, [e], False) for layer, e in zip(layers, experts, strict=True)]


def _flat_tokens(manifest: Manifest, top_k: int, tokens: int, seed: int) -> list[Call]:
    from cachecd.plan.routing import flat

    return flat(manifest, top_k, tokens, seed + 2).calls
