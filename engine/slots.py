"""Which expert each slot of the pool holds, which slots are free, and which may be taken.

The pool (``cachecd_engine.pool``) is one stack of slots shared by every MoE layer; this table
is its bookkeeping, with no MLX in it.

Invariants:
- A slot holds at most one expert and an expert is in at most one slot. A slot is ``free``,
  ``filling`` (bytes on their way: its read has not finished) or ``ready``.
- A slot is given to another expert only through ``claim``, which never takes a slot of
  ``keep`` (the call's own experts) or a filling slot. A slot read by queued work (fenced: its
  reader's output is not known to be evaluated) is taken only if the caller asks, and then
  the caller gets those outputs and must evaluate them before writing (``Claim.fences``). The
  bank clears the fences at each routing read-back, whose eval includes them.
- Which expert leaves is the policy's (``cachecd.store.policies``, driven as the daemon's store
  drives it: ``on_insert`` when an expert takes a slot, ``on_access`` for each use).
- Not thread-safe: only the thread that runs the model calls it (read-ahead threads only fill
  slots this thread claimed for them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cachecd.store.policies import EvictionPolicy, make_policy

# Chosen by bench/ram_tier.py: with fewer slots than one token's experts, lru and lfuda keep
# nothing the next token needs (0 hits on every trace), wlfu keeps 0.40-0.80 of Belady.
DEFAULT_POLICY = "wlfu"

Key = tuple[int, int]  # (layer, expert)


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
    def __init__(self, capacity: int, policy: str = DEFAULT_POLICY) -> None:
        if capacity < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {capacity}")
        self.capacity = capacity
        self.policy_name = policy
        self.policy: EvictionPolicy = make_policy(policy)
        self.counters = TableCounters()
        self._slot: dict[Key, int] = {}
        self._owner: list[Key | None] = [None] * capacity
        self._filling: set[int] = set()
        self._fence: dict[int, Any] = {}  # slot -> output of the queued work that reads it
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest first
        self.version = 0  # changes whenever which expert is where (or ready) changes

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

    def use(self, layer: int, experts: Iterable[int]) -> dict[int, int]:
        """The slots of the experts held (ready or filling), counting one use of each asked."""
        found: dict[int, int] = {}
        asked = 0
        for e in experts:
            asked += 1
            slot = self._slot.get((layer, e))
            if slot is not None:
                found[e] = slot
                self.policy.on_access(_name(layer, e))
        self.counters.hits += len(found)
        self.counters.misses += asked - len(found)
        return found

    def claim(self, layer: int, experts: list[int], keep: Iterable[int] = (),
              take_fenced: bool = True, use: bool = False) -> Claim:
        """Slots for experts not held: free ones first, then the policy's victims. Slots in
        ``keep`` and filling slots are not taken, nor fenced ones unless ``take_fenced``;
        fewer slots than asked may come back. ``use``: the claim is for a use (a demand read,
        counted as the store counts the use that caused a fetch), not a guess."""
        claim = Claim({})
        todo = [e for e in experts if (layer, e) not in self._slot]
        while todo and self._free:
            claim.slots[todo.pop(0)] = self._take_free()
        if todo:
            for slot in self._victims(len(todo), set(keep), take_fenced):
                fence = self._evict(slot)
                if fence is not None:
                    claim.fences.append(fence)
                claim.slots[todo.pop(0)] = slot
        for e, slot in claim.slots.items():
            self._insert(layer, e, slot)
            if use:
                self.policy.on_access(_name(layer, e))
        return claim

    def _take_free(self) -> int:
        return self._free.pop()

    def _victims(self, n: int, keep: set[int], take_fenced: bool) -> list[int]:
        # Only the few slots in use now are excluded (the call's own, reads under way, readers
        # still queued), so this stays cheap in a pool of thousands of slots.
        held = keep | self._filling
        if not take_fenced:
            held |= self._fence.keys()
        excluded = {_name(*key) for s in held if (key := self._owner[s]) is not None}
        names = self.policy.victims(n, excluded)  # equal sizes: one "byte" an expert
        return [self._slot[_key(name)] for name in names[:n]]

    def _evict(self, slot: int) -> Any:
        self.version += 1
        key = self._owner[slot]
        assert key is not None
        del self._slot[key]
        self._owner[slot] = None
        self.policy.on_remove(_name(*key))
        self.counters.evicted += 1
        return self._fence.pop(slot, None)

    def _insert(self, layer: int, expert: int, slot: int) -> None:
        self.version += 1
        self._slot[(layer, expert)] = slot
        self._owner[slot] = (layer, expert)
        self._filling.add(slot)
        self.policy.on_insert(_name(layer, expert), 1)
        self.counters.inserted += 1

    def filled(self, slots: Iterable[int]) -> None:
        """These slots' bytes are in place."""
        self.version += 1
        self._filling.difference_update(slots)

    def forget(self, slots: Iterable[int]) -> None:
        """Free slots whose read failed or was dropped (their bytes are not the expert's)."""
        for slot in slots:
            if self._owner[slot] is not None:
                self._evict(slot)
                self.counters.evicted -= 1  # not an eviction: the expert never arrived
            self._filling.discard(slot)
            self._free.append(slot)


    def resize(self, capacity: int) -> dict[int, int]:
        """Change the number of slots; return old slot -> new slot for the experts kept (the
        policy's victims leave first when shrinking). Every fence must be settled before."""
        if capacity < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {capacity}")
        assert not self._filling, "resize while reads are under way"
        self.version += 1
        excess = len(self._slot) - capacity
        if excess > 0:
            for slot in self._victims(excess, set(), True):
                self._evict(slot)
        self._fence.clear()
        moves = {old: new for new, old in enumerate(sorted(self._slot.values()))}
        self._slot = {key: moves[old] for key, old in self._slot.items()}
        self._owner = [None] * capacity
        for key, slot in self._slot.items():
            self._owner[slot] = key
        self._free = [s for s in range(capacity - 1, -1, -1) if self._owner[s] is None]
        self.capacity = capacity
        return moves

    def fence(self, slots: Iterable[int], output: Any) -> None:
        """Queued work computing ``output`` reads these slots."""
        for slot in slots:
            self._fence[slot] = output

    def fenced(self) -> list[Any]:
        """The outputs of queued work that reads any slot (each once)."""
        return list({id(o): o for o in self._fence.values()}.values())

    def clear_fences(self) -> None:
        """Every fenced output has been evaluated."""
        self._fence.clear()


def _name(layer: int, expert: int) -> str:
    return f"{layer}:{expert}"


def _key(name: str) -> Key:
    layer, expert = name.split(":")
    return int(layer), int(expert)
