"""Which expert each slot of the pool holds, which slots are free, and which may be taken.

The pool (``cachecd_engine.pool.arrays``) is one stack of slots shared by every MoE layer; this table
is its bookkeeping, with no MLX in it.

Invariants:
- A slot holds at most one expert and an expert is in at most one slot. A slot is ``free``,
  ``filling`` (bytes on their way: its read has not finished) or ``ready``.
- A slot is given to another expert only through ``claim``, which never takes a slot of
  ``keep`` (the call's own experts) or a filling slot. A slot read by queued work (fenced: its
  reader's output is not known to be evaluated) is taken only if the caller asks, and then
  the caller gets those outputs and must evaluate them before writing (``Claim.fences``).
- A fence belongs to the slot's memory, not to the expert in it: it stays through an eviction
  and a ``forget`` (a free slot may still be read by queued work: a claim undone before its
  readers were evaluated) and is cleared only by ``clear_fences`` with the outputs an
  evaluation that has returned included (a routing read-back, a claim's wait, ``settle``).
- Every miss needs a slot (the kernel reads only the pool). The default policy, ``cycle``
  (``cachecd_engine.pool.cycle.LayerCycle``), admits every miss and ranks the slots for decode's
  layer cycle, with the router's forecast of the next layer (``forecast``); chosen by
  bench/pool_policy.py, where the store's policies below kept the wrong experts.
- With a store policy (``cachecd.store.policies``: lru, lfuda, wlfu) the table admits by
  frequency, as TinyLFU does: an expert that takes a slot of a full pool joins the policy's part (the
  kept experts, ranked by ``cachecd.store.policies`` as the daemon's store drives it) only if it
  has been used more often than the kept expert the policy would give up first, which then
  moves to the scratch part; otherwise the expert itself is scratch. Scratch slots are taken
  first (oldest first), so a pool smaller than one step's experts keeps its most used ones
  instead of cycling through all of them (a replay of flat and skewed routing at 0.7 steps'
  worth: hit rate 0.00 for lru, lfuda and wlfu alone, 0.12 and 0.36 so, against 0.41 and 0.54
  for Belady; at 1.5 and 2.5 steps' worth within 0.06 of wlfu alone, above it on flat routing).
  Uses are counted per expert and halved every ``HALVE_EVERY`` x slots uses.
- ``version`` changes whenever a slot's expert or its readiness changes, and ``moved`` names
  every such slot to its reader (the speculative step's device map).
- Not thread-safe: only the thread that runs the model calls it (read-ahead threads only fill
  slots this thread claimed for them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cachecd.store.policies import EvictionPolicy, make_policy
from cachecd_engine.pool.cycle import LayerCycle, Ranker

# Chosen by bench/pool_policy.py (decode traces with K3's statistics and the project's own):
# above LRU, LFU and wlfu (with admission by use counts) at every pool size measured.
DEFAULT_POLICY = "cycle"
POOL_POLICIES = {"cycle": LayerCycle}  # policies of the pool's own, ranking slots


Key = tuple[int, int]  # (layer, expert)
HALVE_EVERY = 16  # uses counted, times the slots, between halvings of every count


@dataclass
class Claim:
    slots: dict[int, int]  # expert -> slot given to it
    # Outputs of queued work that read the slots taken (mx.arrays): evaluate before writing.
    fences: list[Any] = field(default_factory=list)


@dataclass
class TableCounters:
    hits: int = 0
    misses: int = 0
    inserted: int = 0
    evicted: int = 0


class SlotTable:
    def __init__(self, capacity: int, policy: str | Ranker = DEFAULT_POLICY,
                 experts_per_layer: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {capacity}")
        self.capacity = capacity
        self.policy_name = policy if isinstance(policy, str) else type(policy).__name__
        # Either a ranker of the pool's own (every miss admitted) or a store policy (admission).
        self.ranker: Ranker | None = None
        self.policy: EvictionPolicy | None = None
        if not isinstance(policy, str):
            self.ranker = policy
        elif policy in POOL_POLICIES:
            self.ranker = POOL_POLICIES[policy](capacity, experts_per_layer)
        else:
            self.policy = make_policy(policy)
        self.counters = TableCounters()
        self._slot: dict[Key, int] = {}
        self._owner: list[Key | None] = [None] * capacity
        self._filling: set[int] = set()
        self._fence: dict[int, Any] = {}  # slot -> output of the queued work that reads it
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest first
        self._scratch: OrderedDict[int, None] = OrderedDict()  # slots outside the policy
        self._uses: dict[Key, int] = {}  # uses per expert, halved now and then
        self._counted = 0
        self.version = 0  # changes whenever which expert is where (or ready) changes
        # The slots where that changed since ``moved`` was last asked (None: any may have), and
        # who asked.
        self._moved: set[int] | None = None
        self._reader: object = None
        # A layer-major prefill at this layer (engine.prefill): layers before it go first.
        self.prefill_layer: int | None = None

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: Key) -> bool:
        return key in self._slot

    def slot(self, key: Key) -> int | None:
        return self._slot.get(key)

    def owner(self, slot: int) -> Key | None:
        return self._owner[slot]

    def filling(self, slot: int) -> bool:
        return slot in self._filling

    def items(self) -> Iterable[tuple[Key, int]]:
        return self._slot.items()

    @property
    def _kept(self) -> EvictionPolicy:
        assert self.policy is not None
        return self.policy

    def forecast(self, layer: int, experts: Iterable[int]) -> None:
        """The router's guess of ``layer``'s experts for its coming call (``Prefetcher``)."""
        if self.ranker is not None:
            self.ranker.forecast(layer, experts)

    def use(self, layer: int, experts: Iterable[int]) -> dict[int, int]:
        """The slots of the experts held (ready or filling), counting one use of each asked."""
        if self.ranker is not None:
            experts = list(experts)
            self.ranker.visit(layer, experts)
            found = {e: s for e in experts if (s := self._slot.get((layer, e))) is not None}
            self.counters.hits += len(found)
            self.counters.misses += len(experts) - len(found)
            return found
        found = {}
        asked = 0
        for e in experts:
            asked += 1
            self._count((layer, e))
            slot = self._slot.get((layer, e))
            if slot is None:
                continue
            found[e] = slot
            if slot in self._scratch:
                self._promote(slot, set(found.values()))
            else:
                self._kept.on_access(_name(layer, e))
        self.counters.hits += len(found)
        self.counters.misses += asked - len(found)
        return found

    def _count(self, key: Key) -> None:
        self._uses[key] = self._uses.get(key, 0) + 1
        self._counted += 1
        if self._counted >= HALVE_EVERY * self.capacity:
            self._counted = 0
            self._uses = {k: n >> 1 for k, n in self._uses.items() if n > 1}

    def _weakest(self, keep: set[int]) -> int | None:
        """The slot of the kept expert the policy would give up first (not one of ``keep``)."""
        excluded = {_name(*key) for s in keep | self._filling if (key := self._owner[s])}
        names = self._kept.victims(1, excluded)
        return self._slot[_key(names[0])] if names else None

    def _promote(self, slot: int, keep: set[int]) -> None:
        """A scratch expert used again joins the kept part if it is used more than the
        weakest kept one, which takes its place in the scratch part."""
        key = self._owner[slot]
        assert key is not None
        weak = self._weakest(keep)
        weak_key = self._owner[weak] if weak is not None else None
        if weak_key is not None and self._uses.get(key, 0) <= self._uses.get(weak_key, 0):
            return
        del self._scratch[slot]
        self._kept.on_insert(_name(*key), 1)
        self._kept.on_access(_name(*key))
        if weak is not None and weak_key is not None:
            self._kept.on_remove(_name(*weak_key))
            self._scratch[weak] = None

    def claim(self, layer: int, experts: list[int], keep: Iterable[int] = (),
              take_fenced: bool = True, use: bool = False, ahead: bool = False) -> Claim:
        """Slots for experts not held: free ones first, then the policy's victims. Slots in
        ``keep`` and filling slots are not taken, nor fenced ones unless ``take_fenced``;
        fewer slots than asked may come back. ``use``: the claim is for a use (a demand read,
        counted as the store counts the use that caused a fetch), not a guess. ``ahead``: a
        read-ahead of guessed experts, which takes free slots and only the slots the policy
        ranks below the guessed experts themselves (never a kept one: ``LayerCycle.below``;
        a store policy's table gives it free slots only)."""
        claim = Claim({})
        keep = set(keep)
        todo = [e for e in experts if (layer, e) not in self._slot]
        placed = []  # (expert, slot, whether the slot was free)
        while todo and (slot := self._take_free(take_fenced, claim.fences)) is not None:
            placed.append((todo.pop(0), slot, True))
        if todo:
            victims = self._below(layer, todo, keep, take_fenced) if ahead else \
                self._victims(len(todo), keep, take_fenced)
            for slot in victims:
                fence = self._evict(slot)
                if fence is not None:
                    claim.fences.append(fence)
                placed.append((todo.pop(0), slot, False))
        taken = keep | {slot for _, slot, _ in placed}
        for e, slot, free in placed:
            claim.slots[e] = slot
            if self.ranker is not None:
                self._insert(layer, e, slot)
                continue
            self._insert(layer, e, slot, admit=free or self._admits((layer, e), taken))
            if use and slot not in self._scratch:
                self._kept.on_access(_name(layer, e))
        return claim

    def _admits(self, key: Key, keep: set[int]) -> bool:
        """A new expert in a full pool joins the kept part if it is used more often than the
        weakest kept expert, which then moves to the scratch part."""
        weak = self._weakest(keep)
        weak_key = self._owner[weak] if weak is not None else None
        if weak is None or weak_key is None:
            return True  # no kept expert may give way: the kept part grows
        if self._uses.get(key, 0) <= self._uses.get(weak_key, 0):
            return False
        self._kept.on_remove(_name(*weak_key))
        self._scratch[weak] = None
        return True

    def _take_free(self, take_fenced: bool, fences: list[Any]) -> int | None:
        """A free slot, lowest first; one still fenced only if ``take_fenced`` (its reader then
        goes to ``fences``). Free slots are fenced only after an undone claim: rare."""
        if not self._fence:
            return self._free.pop() if self._free else None
        for i in range(len(self._free) - 1, -1, -1):
            slot = self._free[i]
            fence = self._fence.get(slot)
            if fence is None or take_fenced:
                del self._free[i]
                if fence is not None:
                    fences.append(fence)
                return slot
        return None

    def _victims(self, n: int, keep: set[int], take_fenced: bool) -> list[int]:
        """Scratch slots first, oldest first, then the policy's victims. Only the few slots in
        use now are excluded (the call's own, reads under way, readers still queued), so this
        stays cheap in a pool of thousands of slots."""
        held = keep | self._filling
        if not take_fenced:
            held |= self._fence.keys()
        if self.prefill_layer is not None:
            return self._prefill_victims(n, held, self.prefill_layer)
        return self._ranked(n, held)

    def _below(self, layer: int, experts: list[int], keep: set[int],
               take_fenced: bool) -> list[int]:
        """Victims for a read-ahead: only slots the ranker scores below the guessed experts."""
        below = getattr(self.ranker, "below", None)
        if below is None or self.prefill_layer is not None:
            return []
        held = keep | self._filling
        if not take_fenced:
            held |= self._fence.keys()
        return list(below(len(experts), held, layer, experts))

    def _prefill_victims(self, n: int, held: set[int], at: int) -> list[int]:
        """During a layer-major prefill at layer ``at``: the slots of the layers before it
        (not needed again until decode), then the ranked order without layer ``at``'s, then
        its own: with a pool of one layer's experts, no expert of it is read twice."""
        dead, current = [], set()
        for s, key in enumerate(self._owner):
            if key is not None and s not in held:
                if key[0] < at:
                    dead.append(s)
                elif key[0] == at:
                    current.add(s)
        out = dead[:n]
        if len(out) < n:
            out += self._ranked(n - len(out), held | set(out) | current)
        if len(out) < n:
            out += self._ranked(n - len(out), held | set(out))
        return out

    def _ranked(self, n: int, held: set[int]) -> list[int]:
        """Scratch slots first, oldest first, then the policy's victims, none of ``held``."""
        if self.ranker is not None:
            return self.ranker.victims(n, held)
        out = [s for s in self._scratch if s not in held][:n]
        if len(out) < n:
            excluded = {_name(*key) for s in held if (key := self._owner[s]) is not None}
            names = self._kept.victims(n - len(out), excluded)  # one "byte" an expert
            out += [self._slot[_key(name)] for name in names[: n - len(out)]]
        return out

    def _evict(self, slot: int) -> Any:
        self._change(slot)
        key = self._owner[slot]
        assert key is not None
        del self._slot[key]
        self._owner[slot] = None
        if self.ranker is not None:
            self.ranker.left(slot)
        elif slot in self._scratch:
            del self._scratch[slot]
        else:
            self._kept.on_remove(_name(*key))
        self.counters.evicted += 1
        return self._fence.get(slot)  # kept until the evaluation that includes it clears it

    def _insert(self, layer: int, expert: int, slot: int, admit: bool = True) -> None:
        self._change(slot)
        self._slot[(layer, expert)] = slot
        self._owner[slot] = (layer, expert)
        self._filling.add(slot)
        if self.ranker is not None:
            self.ranker.placed(slot, (layer, expert))
        elif admit:
            self._kept.on_insert(_name(layer, expert), 1)
        else:
            self._scratch[slot] = None
        self.counters.inserted += 1

    def filled(self, slots: Iterable[int]) -> None:
        """These slots' bytes are in place."""
        done = self._filling.intersection(slots)
        if done:  # a call whose experts were all held changes nothing
            self._filling -= done
            self._change(*done)

    def _change(self, *slots: int) -> None:
        """Which expert these slots hold, or whether it is ready, changed."""
        self.version += 1
        if self._moved is not None:
            self._moved.update(slots)

    def moved(self, reader: object) -> set[int] | None:
        """The slots whose expert or readiness changed since ``reader`` last asked (the
        speculative step's device map, ``speculate.DeviceMap``); None, for any may have, when it
        has not asked before, when another reader asked since, or after a resize (slots
        renumbered)."""
        moved = self._moved if reader is self._reader else None
        self._moved, self._reader = set(), reader
        return moved

    def forget(self, slots: Iterable[int]) -> None:
        """Free slots whose read failed or was dropped (their bytes are not the expert's);
        their fences stay."""
        for slot in slots:
            if self._owner[slot] is not None:
                self._evict(slot)
                self.counters.evicted -= 1  # not an eviction: the expert never arrived
            self._filling.discard(slot)
            self._free.append(slot)


    def resize(self, capacity: int) -> dict[int, int]:
        """Change the number of slots; return old slot -> new slot for the experts kept (scratch
        experts leave first when shrinking, then the policy's victims). Every fence must be
        settled before."""
        if capacity < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {capacity}")
        assert not self._filling, "resize while reads are under way"
        self.version += 1
        self._moved = None
        excess = len(self._slot) - capacity
        if excess > 0:
            for slot in self._victims(excess, set(), True):
                self._evict(slot)
        self._fence.clear()
        moves = {old: new for new, old in enumerate(sorted(self._slot.values()))}
        self._slot = {key: moves[old] for key, old in self._slot.items()}
        self._scratch = OrderedDict((moves[s], None) for s in self._scratch)
        self._owner = [None] * capacity
        for key, slot in self._slot.items():
            self._owner[slot] = key
        self._free = [s for s in range(capacity - 1, -1, -1) if self._owner[s] is None]
        self.capacity = capacity
        if self.ranker is not None:
            self.ranker.resize(capacity, self._owner)
        return moves

    def swap(self, pairs: list[tuple[int, int]]) -> None:
        """Exchange what each pair of slots holds (an expert, or nothing): the bank moves the
        bytes the same way (``PoolMemory.swap``). Neither slot may be filling or fenced (the
        caller evaluates their readers first); a store policy sees no change (same experts), a
        ranker is told which expert each slot holds now."""
        for a, b in pairs:
            assert a not in self._filling and b not in self._filling, "swap of a filling slot"
            assert a not in self._fence and b not in self._fence, "swap of a fenced slot"
            ka, kb = self._owner[a], self._owner[b]
            self._owner[a], self._owner[b] = kb, ka
            for key, slot in ((ka, b), (kb, a)):
                if key is not None:
                    self._slot[key] = slot
            if self.ranker is not None:  # it ranks slots: tell it which expert each holds now
                for slot, key in ((a, kb), (b, ka)):
                    if key is None:
                        self.ranker.left(slot)
                    else:
                        self.ranker.placed(slot, key)
            sa, sb = a in self._scratch, b in self._scratch
            if sa != sb:
                del self._scratch[a if sa else b]
                self._scratch[b if sa else a] = None
            if (ka is None) != (kb is None):
                self._free.remove(a if ka is None else b)
                self._free.append(b if ka is None else a)
                self._free.sort(reverse=True)  # pop() hands out the lowest first
        if pairs:
            self._change(*(slot for pair in pairs for slot in pair))

    def fence(self, slots: Iterable[int], output: Any) -> None:
        """Queued work computing ``output`` reads these slots."""
        for slot in slots:
            self._fence[slot] = output

    def fences_of(self, slots: Iterable[int]) -> list[Any]:
        """The outputs of queued work that reads any of these slots (each once)."""
        return list({id(o): o for s in slots if (o := self._fence.get(s)) is not None}.values())

    def fenced(self) -> list[Any]:
        """The outputs of queued work that reads any slot (each once)."""
        return list({id(o): o for o in self._fence.values()}.values())

    def clear_fences(self, evaluated: Iterable[Any]) -> None:
        """These outputs have been evaluated (an eval that included them returned): no queued
        work reads the slots they fenced. Fences of other outputs stay."""
        if self._fence:
            done = {id(o) for o in evaluated}
            self._fence = {s: o for s, o in self._fence.items() if id(o) not in done}

    def unfilled(self) -> list[int]:
        """Slots claimed whose bytes are not in place yet."""
        return list(self._filling)


def _name(layer: int, expert: int) -> str:
    return f"{layer}:{expert}"


def _key(name: str) -> Key:
    layer, expert = name.split(":")
    return int(layer), int(expert)
