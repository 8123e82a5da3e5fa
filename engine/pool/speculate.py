"""A decode step with no per-layer round trip: the expert -> slot map on the device.

When every expert a token routes to is already in the pool, nothing needs the host between
layers. So a decode step first runs with each layer's slots looked up on the device (a gather
from a map the bank keeps in step with its table), and the routing of every layer is read back
once, at the end. If every routed expert was in a ready slot, the step is exactly the per-layer
step (the same kernels over the same slot numbers: identical logits) and is kept. If any was
not, the step is thrown away: the caches go back to where they were and the step runs again
the per-layer way, which reads the missing experts. The whole step is queued at once, as the
resident model's is, and the host waits only for the routing before it checks.

Invariants:
- A kept step computed every row from the expert the model routed it to: the host checks every
  layer's routed experts against the table the device map was built from, which nothing
  changes while the step is built (no slot is claimed until the read-back). The map is the
  whole table's: it is updated from the slots the table names as changed since it last asked
  (``SlotTable.moved``: every slot whose expert or readiness changed), and built whole for a
  new table or after a resize.
- A thrown-away step leaves no trace: it is let finish (its kernels read slots) before any slot
  is refilled, the KV caches' offsets and the linear-attention states are restored, and
  nothing of it is kept.
- A step clears only fences it waited for: the routing's read-back waits for the routing
  alone, and queued work from before the step (another prompt cache's step, say) need not be
  its ancestor. A kept step waits for those outputs (done already when they are the previous
  step of the same cache: each is then a wait on a finished event) before it fences its own;
  a thrown-away step leaves them to the per-layer read-back.
- Only what can be restored is speculated: batch 1, one token, every cache a ``KVCache`` or an
  ``ArraysCache`` without lengths or padding (other kinds always take the per-layer step).
- A step that missed makes the next ones per-layer, twice as many after each miss in a row (up
  to ``MAX_BACKOFF``: a pool smaller than the working set misses nearly every step); a step
  that is kept lets the next one try again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

from cachecd_engine.pool import dispatch
from cachecd_engine.pool.bank import ExpertBank
from cachecd_engine.pool.calls import allow_sorted, distinct
from cachecd_engine.pool.dispatch import current_backend
from cachecd_engine.pool.slots import SlotTable


def speculate_by_default() -> bool:
    """Where a read-back costs a round trip to a device (a GPU). On the CPU the per-layer
    read-back is a wait on the same cores, and a missed step costs a whole step again."""
    return current_backend() != "cpu"


MAX_BACKOFF = 64  # steps


class Missed(Exception):
    """A layer call could not run on the device map (its kernel needs the host): step again."""


def plain_caches(cache: Any) -> bool:
    """Non-empty, and only plain ``KVCache``s and unpadded ``ArraysCache``s: the caches whose
    state is just their arrays and offset (what a snapshot restores, what a held-back prefill
    step may leave behind)."""
    if not cache:
        return False
    for c in cache:
        if type(c) is KVCache:
            continue
        if type(c) is ArraysCache and c.lengths is None and c.left_padding is None:
            continue
        return False
    return True


def restorable(inputs: mx.array, cache: Any) -> bool:
    return inputs.ndim == 2 and inputs.shape == (1, 1) and plain_caches(cache)


def snapshot(cache: list[Any]) -> list[Any]:
    """What a step changes in each cache: a KV cache's offset and arrays (the step writes past
    the offset, which a second step overwrites), an arrays cache's state list."""
    return [(c.offset, c.keys, c.values) if type(c) is KVCache else list(c.cache) for c in cache]


def restore(cache: list[Any], snap: list[Any]) -> None:
    for c, s in zip(cache, snap, strict=True):
        if type(c) is KVCache:
            c.offset, c.keys, c.values = s
        else:
            c.cache = list(s)


class DeviceMap:
    """The table's expert -> slot map as an MLX array ``[moe layers, experts]`` (uint32),
    made again only when the table changed, from a host copy in which only the entries of the
    slots that changed (``SlotTable.moved``) are written; entries not ready hold slot 0 (their
    rows' results are never kept: the host check finds them)."""

    def __init__(self, bank: ExpertBank, layers: list[int]) -> None:
        self.bank = bank
        self.row = {layer: i for i, layer in enumerate(layers)}
        self._array: mx.array | None = None
        self._version = -1
        self._table: SlotTable | None = None  # the table the host copy follows
        self._host = np.zeros((len(self.row), bank.experts_per_layer), np.uint32)
        self._entry = np.zeros(0, np.int64)  # per slot, the entry it is written in (flat), or -1

    def array(self) -> mx.array:
        table = self.bank.table
        assert table is not None
        if self._array is None or self._version != table.version or self._table is not table:
            moved = table.moved(self)
            if moved is None or self._table is not table:  # a new table, or slots renumbered
                self._host = np.zeros((len(self.row), self.bank.experts_per_layer), np.uint32)
                self._entry = np.full(table.capacity, -1, np.int64)
                moved = {slot for _, slot in table.items()}
            self._table = table
            self._write(table, moved)
            self._array = mx.array(self._host)  # a copy: the host copy may change after
            self._version = table.version
        return self._array

    def _write(self, table: SlotTable, moved: set[int]) -> None:
        """The entries of these slots as the table has them now: every old entry of theirs
        cleared first, then each one's ready expert's written (an expert that moved between two
        of them is cleared, then written where it is now)."""
        flat, width = self._host.reshape(-1), self._host.shape[1]
        changed = np.fromiter(moved, np.int64, len(moved))
        old = self._entry[changed]
        flat[old[old >= 0]] = 0
        self._entry[changed] = -1
        owner, filling, row_of = table.owner, table.filling, self.row.get
        entries, slots = [], []
        for slot in moved:
            key = owner(slot)
            if key is not None and (row := row_of(key[0])) is not None and not filling(slot):
                entries.append(row * width + key[1])
                slots.append(slot)
        flat[entries] = slots  # no two slots hold one expert: no entry is written twice
        self._entry[slots] = entries


class Speculator:
    """Runs decode steps on the device map when they can be kept (see the module docstring)."""

    def __init__(self, bank: ExpertBank, layers: list[int]) -> None:
        self.bank = bank
        self.map = DeviceMap(bank, layers)
        self.calls: list[tuple[int, mx.array, mx.array]] | None = None  # while a step runs
        self._backoff = 0  # per-layer steps to take after the next miss (doubles, then resets)
        self._wait = 0  # per-layer steps still to take before trying again
        self.kept = 0  # steps kept
        self.missed = 0  # steps thrown away

    @property
    def active(self) -> bool:
        return self.calls is not None

    def layer_call(self, layer: int, glu: Any, x: mx.array, indices: mx.array) -> mx.array:
        """A layer's expert output with its slots looked up on the device: no read-back. Kept
        only if the host later finds every routed expert ready (``_settle``)."""
        assert self.calls is not None
        bank = self.bank
        t0 = time.perf_counter()
        target = dispatch.resident_kernel(bank.backend, bank.spec.mode is not None,
                                          indices.size, bank.experts_per_layer)
        fit = bank.fit(target, indices.size, indices.size)
        if fit.pad:  # dummy rows need the routing on the host
            raise Missed(f"layer {layer}: the resident kernel needs dummy rows here")
        allow_sorted(glu, fit.sorted)
        y = glu(x, self._map[self.map.row[layer]][indices])
        bank.stats.plan_s += time.perf_counter() - t0
        self.calls.append((layer, indices, y))
        return y

    def step(self, forward: Callable[[], mx.array], inputs: mx.array, cache: Any) -> mx.array:
        """``forward()`` on the device map if it can be kept, else the per-layer way."""
        bank = self.bank
        if self._wait or bank.table is None or not restorable(inputs, cache):
            self._wait = max(0, self._wait - 1)
            return forward()
        bank.fill.sweep()  # every slot the device map names ready holds its expert whole
        bank.fill.derive_staged()
        snap = snapshot(cache)
        fenced = bank.fenced()
        self._map = self.map.array()
        self.calls = []
        try:
            logits = forward()
            calls = self.calls
        except Missed:
            calls = None
        finally:
            self.calls = None
        if calls is not None:
            flat = mx.concatenate([i.reshape(-1) for _, i, _ in calls])
            # The whole step runs on; the host waits only for the routing, then checks it.
            mx.async_eval(logits, flat, *fenced)
            if self._keep(calls, flat, fenced):
                self.kept += 1
                self._backoff = 0
                return logits
            mx.eval(logits)  # its queued kernels read slots: let them finish before refills
        self.missed += 1
        self._backoff = min(MAX_BACKOFF, max(1, 2 * self._backoff))
        self._wait = self._backoff
        restore(cache, snap)
        return forward()

    def _keep(self, calls: list[tuple[int, mx.array, mx.array]], flat: mx.array,
              fenced: list[mx.array]) -> bool:
        """The read-back of every layer's routing; keep the step if all were ready slots."""
        t0 = time.perf_counter()
        routed_all = np.array(flat)  # waits for the routing only
        self.bank.stats.readback_s += time.perf_counter() - t0
        pos, routed = 0, []
        for _, i, _ in calls:
            routed.append(routed_all[pos : pos + i.size].reshape(i.shape))
            pos += i.size
        return self._settle([(layer, r, y) for (layer, _, y), r in zip(calls, routed, strict=True)],
                            fenced)

    def _settle(self, calls: list[tuple[int, np.ndarray, mx.array]],
                fenced: list[mx.array]) -> bool:
        """After the read-back: True, with each call counted and fenced as a layer call is,
        if every routed expert was in a ready slot; False (nothing counted, no fence touched)
        if any was not."""
        bank, table = self.bank, self.bank.table
        assert table is not None
        ids_of = [(layer, distinct(routed)) for layer, routed, _ in calls]
        for layer, ids in ids_of:
            for e in ids:
                slot = table.slot((layer, e))
                if slot is None or table.filling(slot):
                    return False
        if fenced:  # scheduled with the step: eval only waits on their events
            mx.eval(fenced)
            table.clear_fences(fenced)
        s = bank.stats
        for (layer, routed, y), (_, ids) in zip(calls, ids_of, strict=True):
            table.fence(table.use(layer, ids).values(), y)
            s.layer_calls += 1
            s.groups += 1
            s.rows += routed.size
            s.experts_routed += len(ids)
            s.ram_hits += len(ids)
            bank.fill.guessed.difference_update((layer, e) for e in ids)
            if bank.trace is not None:
                bank.trace(layer, routed)
        return True
