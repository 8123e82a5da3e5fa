"""The expert bank: a layer call's routed experts into slots of the pool, and the call.

Invariants (the bit-identity argument):
- Every routed expert is used; none is skipped, pruned or approximated.
- The pool (``pool.PoolMemory``) holds experts' bytes as the checkpoint has them, in arrays of the
  same dtype and layout as the resident stack, one slot an expert; a call passes each row's
  slot as the gather index, so every row meets the same weights as in the resident model. Rows
  may be ordered by slot rather than by expert: each of MLX's gather kernels computes a row
  from that row's input and its expert's weights alone (``dispatch``).
- Every gather reaches the kernel the resident call reaches on this backend (``dispatch``, with
  E = the pool's slots): the ``sorted_indices`` flag and, in groups, dummy rows are set so. A
  call routing to more experts than the pool holds runs in groups of experts; the outputs are
  put back in the resident order.
- A slot is written only when no queued work reads it: the outputs of calls that read slots
  are fences, evaluated with the next routing read-back (``synced``) or before their slots are
  refilled, and read-ahead never takes a fenced slot.
- The computation is mlx-lm's own: its SwitchGLU when the call is whole, else its projections
  and activation group by group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from cachecd import errors
from cachecd_engine import dispatch
from cachecd_engine.formats import ExpertLayout, Piece, QuantSpec, StackLayout, pieces
from cachecd_engine.cuda_memory import Copier
from cachecd_engine.memory import PoolSizer
from cachecd_engine.pool import PoolMemory
from cachecd_engine.slots import DEFAULT_POLICY, Key, SlotTable

Targets = Sequence[Sequence[memoryview]]  # per expert, the buffers its bytes fill in order
MIN_SLOTS = 2  # one group computes while the next is read
STAGING_BYTES = 512 << 20  # pinned staging for misses on CUDA: a batch of reads at most


class ExpertSource(Protocol):
    """Where expert bytes come from (the daemon client in production)."""

    def read_into(self, layer: int, ids: list[int], targets: Targets) -> int:
        """Read each expert's bytes into its targets (thread-safe: read-ahead uses threads);
        the bytes written."""
        ...

    def entry(self, layer: int, expert: int) -> ExpertLayout:
        """The expert's manifest entry (``cachecd.manifest.entries.ExpertEntry``): its layout."""
        ...

    def prefetch(self, layer: int, ids: list[int]) -> None:
        """A fire-and-forget hint that these experts are wanted soon."""
        ...


@dataclass
class EngineStats:
    """Counters since the last ``reset``; the caller reads and resets them per step."""

    layer_calls: int = 0
    groups: int = 0  # kernel calls (one per layer call unless it is split into groups)
    rows: int = 0  # routed (token, slot) pairs
    experts_routed: int = 0  # distinct experts per layer call, summed
    ram_hits: int = 0  # routed experts already in a slot of the pool
    staged_hits: int = 0  # routed experts read ahead into a slot from the guess
    source_hits: int = 0  # experts read from the source on demand
    source_bytes: int = 0  # bytes read from the source (demand and read-ahead)
    copied_bytes: int = 0  # bytes the host wrote into the pool (reads, derived arrays, resizes)
    staged: int = 0  # experts read ahead
    readback_s: float = 0.0  # blocked reading back the routing (it runs what came before)
    wait_s: float = 0.0  # blocked getting experts into slots (reads, queued readers of a slot)
    plan_s: float = 0.0  # the bank's own host work: lookups, policy, indices, building the call

    def reset(self) -> None:
        for name, value in asdict(EngineStats()).items():
            setattr(self, name, value)

    def snapshot(self) -> dict[str, float]:
        return asdict(self)


class ExpertBank:
    """Gets a layer call's experts into slots of the pool and runs the call.

    Args:
        source: expert bytes (the daemon in production).
        spec: the quantization the resident model uses for the experts.
        pool_bytes: memory for the pool of expert slots (at least ``MIN_SLOTS`` slots).
        cap: a hard bound on the pool's memory (``--expert-memory``): too small for
            ``MIN_SLOTS`` slots is an error, not a bigger pool.
        experts_per_layer: experts in the resident stack of a layer (for the kernel decision).
    """

    def __init__(self, source: ExpertSource, spec: QuantSpec, pool_bytes: int,
                 stats: EngineStats | None = None, *, cap: int | None = None,
                 policy: str = DEFAULT_POLICY, experts_per_layer: int = 0,
                 readers: int = 2) -> None:
        self.source = source
        self.spec = spec
        self.pool_bytes = pool_bytes
        self.cap = cap
        self.policy = policy
        self.stats = stats or EngineStats()
        self.experts_per_layer = experts_per_layer
        self.backend = dispatch.current_backend()
        # Optional observer called with (layer, routed ids) once per layer call (engine.trace).
        self.trace: Callable[[int, np.ndarray], None] | None = None
        self.layout: StackLayout | None = None
        self.memory: PoolMemory | None = None
        self.table: SlotTable | None = None
        self._templates: list[SwitchGLU] = []
        self._pieces: dict[Key, tuple[Piece, ...]] = {}
        self._reads: dict[int, tuple[Key, Future[int]]] = {}  # slot -> read-ahead under way
        self._underived: list[int] = []  # slots filled by read-ahead, derived arrays not yet
        self._guessed: set[Key] = set()  # experts read ahead and not used yet
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="cachecd-ahead")
        self.sizer: PoolSizer | None = None  # set when the pool's size is the measured default
        self.speculator: Any = None  # cachecd_engine.speculate.Speculator, when steps speculate
        self.min_slots = MIN_SLOTS  # the least a default-sized pool gets (the loader: 2 calls)
        self.max_slots = 0  # if set: the experts the model has (more slots would stay empty)
        # On a discrete CUDA GPU misses go through pinned memory and the copy engine.
        self.copier = Copier() if self.backend == "cuda" else None

    # the pool ---------------------------------------------------------------------------------
    def pieces(self, layer: int, expert: int) -> tuple[Piece, ...]:
        key = (layer, expert)
        got = self._pieces.get(key)
        if got is None:
            entry = self.source.entry(layer, expert)
            if self.layout is None:
                self.layout = StackLayout.of(entry)
            got = self._pieces[key] = pieces(entry, self.layout)
        return got

    def prepare(self, layer: int) -> None:
        """Read the expert layout from the manifest and allocate the pool now."""
        self._pool(layer, 0)

    @property
    def slot_nbytes(self) -> int:
        assert self.layout is not None
        return PoolMemory.slot_nbytes(self.spec, self.layout)

    @property
    def capacity(self) -> int:
        return self.table.capacity if self.table is not None else 0

    def _slots_for(self, pool_bytes: int) -> int:
        one = self.slot_nbytes
        if self.cap is not None:
            if self.cap // one < MIN_SLOTS:
                raise errors.InvalidRequest(
                    f"expert memory of {self.cap} bytes cannot hold two experts of {one} bytes; "
                    f"raise it (cachecd run --expert-memory)")
            pool_bytes = min(pool_bytes, self.cap)
            floor = MIN_SLOTS
        else:
            floor = self.min_slots
        slots = pool_bytes // one
        if self.max_slots:
            slots = min(slots, self.max_slots)
        most = dispatch.max_stack(self.backend, self.spec.mode is not None)
        return min(max(floor, slots), most or slots + floor)

    def _pool(self, layer: int, expert: int) -> tuple[PoolMemory, SlotTable]:
        if self.memory is None or self.table is None:
            self.pieces(layer, expert)
            assert self.layout is not None
            slots = self._slots_for(self.pool_bytes)
            self.memory = PoolMemory(self.spec, self.layout, slots, self.backend)
            self.table = SlotTable(slots, self.policy)
            for glu in self._templates:
                self._hold(glu)
        return self.memory, self.table

    def attach(self, glu: SwitchGLU) -> None:
        """``glu`` (a layer's template) computes from the pool's arrays."""
        self._templates.append(glu)
        if self.memory is not None:
            self._hold(glu)

    def _hold(self, glu: SwitchGLU) -> None:
        assert self.memory is not None
        for proj, arrays in self.memory.arrays.items():
            module = getattr(glu, proj)
            for name, arr in arrays.items():
                setattr(module, name, arr)

    def resize(self, pool_bytes: int) -> None:
        """Give the pool ``pool_bytes``: the experts the policy keeps are copied into the new
        slots, so nothing already local is read again; every output stays the same."""
        self.pool_bytes = pool_bytes
        if self.memory is None or self.table is None:
            return
        slots = self._slots_for(pool_bytes)
        if slots == self.table.capacity:
            return
        self.settle()
        old = self.memory
        moves = self.table.resize(slots)
        self.memory = PoolMemory(self.spec, old.layout, slots, self.backend)
        self.stats.copied_bytes += self.memory.copy_from(old, moves)
        for glu in self._templates:
            self._hold(glu)

    def settle(self) -> None:
        """Finish every read under way and evaluate every queued reader of a slot."""
        for slot in list(self._reads):
            self._finish_read(slot)
        self._derive_staged()
        if self.table is not None:
            fenced = self.table.fenced()
            if fenced:
                mx.eval(fenced)
            self.table.clear_fences()

    def holds(self, layer: int, expert: int) -> bool:
        return self.table is not None and (layer, expert) in self.table

    def fenced(self) -> list[mx.array]:
        """The outputs of queued calls that read slots (evaluate them with the read-back)."""
        return self.table.fenced() if self.table is not None else []

    def synced(self) -> None:
        """The outputs ``fenced`` returned have been evaluated (a routing read-back): no
        queued work reads a slot. A default-sized pool is measured again here now and then."""
        if self.table is not None:
            self.table.clear_fences()
        if self.sizer is not None and self.sizer.due() and self.memory is not None:
            want = self.sizer.target(self.memory.nbytes)
            if want is not None:
                self.resize(want)

    # read-ahead ------------------------------------------------------------------------------
    def stage(self, layer: int, guess: list[int]) -> None:
        """Start reading the guessed experts of ``layer`` that no slot holds into free slots,
        in the background. Never takes a slot that queued work reads."""
        if not guess:
            return
        _, table = self._pool(layer, guess[0])
        self._sweep()
        claim = table.claim(layer, guess, take_fenced=False)
        assert not claim.fences
        for e, slot in claim.slots.items():
            key = (layer, e)
            fut = self._readers.submit(self._read_ahead, layer, e, slot)
            self._reads[slot] = (key, fut)
            self._guessed.add(key)
        self.stats.staged += len(claim.slots)

    def _read_ahead(self, layer: int, expert: int, slot: int) -> int:
        """On a reader thread: the expert's bytes into its slot."""
        memory = self.memory
        assert memory is not None
        return self.source.read_into(layer, [expert],
                                     [memory.targets(slot, self.pieces(layer, expert))])

    def _sweep(self) -> None:
        """Take in read-ahead that has finished (failed ones free their slot)."""
        for slot in [s for s, (_, fut) in self._reads.items() if fut.done()]:
            self._finish_read(slot)

    def _finish_read(self, slot: int) -> bool:
        """Wait for the read-ahead into ``slot``; True if its bytes are in place."""
        assert self.table is not None
        key, fut = self._reads.pop(slot)
        if fut.exception() is not None:  # waits; read again on demand if it is routed
            self.table.forget([slot])
            self._guessed.discard(key)
            return False
        self.table.filled([slot])
        self._underived.append(slot)
        self.stats.source_bytes += self._nbytes(*key)
        self.stats.copied_bytes += fut.result()
        return True

    def _derive_staged(self) -> None:
        if self._underived and self.memory is not None:
            slots, self._underived = self._underived, []
            self.stats.copied_bytes += self.memory.derive(slots)

    # a layer call ----------------------------------------------------------------------------
    def run(self, layer: int, glu: SwitchGLU, x: mx.array, routed: np.ndarray) -> mx.array:
        """The layer's expert output for ``x`` routed to ``routed`` (mlx-lm's shapes)."""
        t0 = time.perf_counter()
        ids = _distinct(routed)
        s = self.stats
        s.layer_calls += 1
        s.rows += routed.size
        s.experts_routed += len(ids)
        _, table = self._pool(layer, ids[0])
        target = dispatch.resident_kernel(self.backend, self.spec.mode is not None, routed.size,
                                          self.experts_per_layer or len(ids))
        whole = len(ids) <= table.capacity
        fit = self._fit(target, routed.size, routed.size) if whole else None
        s.plan_s += time.perf_counter() - t0
        if fit is None or fit.pad:
            return self._run_groups(layer, glu, x, routed, ids, target)
        slots = self.acquire(layer, ids)
        t1 = time.perf_counter()
        _allow_sorted(glu, fit.sorted)
        y = glu(x, mx.array(_local(routed, slots)))
        mx.async_eval(y)
        table.fence(slots.values(), y)
        s.groups += 1
        s.plan_s += time.perf_counter() - t1
        return y

    def _fit(self, target: str, rows: int, call_rows: int) -> dispatch.Fit:
        """How ``rows`` rows of a call over ``call_rows`` reach ``target`` with the pool as the
        stack (the sorted flag may be set only where mlx-lm sorts the call's rows)."""
        return dispatch.fit(self.backend, self.spec.mode is not None, target, rows,
                            self.capacity, call_rows >= dispatch.SORT_ROWS)

    def acquire(self, layer: int, ids: list[int]) -> dict[int, int]:
        """Every expert of ``ids`` in a slot, bytes in place: expert -> slot. Experts not held
        are read now into free slots or the policy's victims (never one of ``ids``')."""
        t0 = time.perf_counter()
        memory, table = self._pool(layer, ids[0])
        self._sweep()
        held = table.use(layer, ids)
        again = [e for e, slot in held.items() if slot in self._reads
                 and not self._finish_read(slot)]  # read-ahead that failed: read it now
        for e in again:
            del held[e]
        staged = self._guessed.intersection((layer, e) for e in held)
        self._guessed.difference_update(staged)
        claimed = self._claim(layer, [e for e in ids if e not in held], set(held.values()))
        self._read_now(layer, claimed)
        self._derive_staged()
        self.stats.copied_bytes += memory.derive(list(claimed.values()))
        self.stats.ram_hits += len(held) - len(staged)
        self.stats.staged_hits += len(staged)
        self.stats.wait_s += time.perf_counter() - t0
        return {**held, **claimed}

    def _claim(self, layer: int, ids: list[int], keep: set[int]) -> dict[int, int]:
        """Slots for ``ids``: free or idle ones first, then ones queued work reads (that work
        is evaluated first), then ones read-ahead is filling (after those reads land)."""
        table = self.table
        assert table is not None
        slots = table.claim(layer, ids, keep, take_fenced=False, use=True).slots
        rest = [e for e in ids if e not in slots]
        if rest:
            more = table.claim(layer, rest, keep, use=True)
            if more.fences:
                mx.eval(more.fences)
            slots.update(more.slots)
            rest = [e for e in rest if e not in more.slots]
        if rest:  # every other slot is being filled by read-ahead: let it land
            for slot in list(self._reads):
                self._finish_read(slot)
            slots.update(table.claim(layer, rest, keep, use=True).slots)
        if len(slots) < len(ids):
            raise errors.InvalidRequest(
                f"{len(ids)} experts do not fit a pool of {table.capacity} slots")
        return slots

    def _read_now(self, layer: int, claimed: dict[int, int]) -> None:
        if not claimed:
            return
        assert self.memory is not None and self.table is not None
        ids = list(claimed)
        try:
            if self.copier is not None and self.copier.on:
                written = sum(self._read_staged(layer, chunk, claimed)
                              for chunk in _chunks(ids, STAGING_BYTES // self._nbytes(layer, ids[0])))
            else:
                targets = [self.memory.targets(claimed[e], self.pieces(layer, e)) for e in ids]
                written = self.source.read_into(layer, ids, targets)
        except BaseException:
            self.table.forget(claimed.values())  # their bytes are not the experts'
            raise
        self.table.filled(claimed.values())
        self.stats.source_hits += len(ids)
        self.stats.source_bytes += sum(self._nbytes(layer, e) for e in ids)
        self.stats.copied_bytes += written

    def _read_staged(self, layer: int, ids: list[int], claimed: dict[int, int]) -> int:
        """Read into pinned staging memory, then copy each tensor to its slot on the GPU's copy
        engine (``cuda_memory``); the bytes written, both copies counted."""
        assert self.memory is not None and self.copier is not None
        sizes = [self._nbytes(layer, e) for e in ids]
        buf = self.copier.staging(sum(sizes))
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        written = self.source.read_into(
            layer, ids, [[buf[a : a + n].data] for a, n in zip(starts, sizes, strict=True)])
        base = buf.ctypes.data
        for e, a in zip(ids, starts, strict=True):
            for offset, n, key in self.pieces(layer, e):
                self.copier.copy(self.memory.address(key, claimed[e]), base + a + offset, n)
        if not self.copier.wait():  # the copier gave up: write these slots from the host
            for e, a, n in zip(ids, starts, sizes, strict=True):
                self.memory.fill(claimed[e], self.pieces(layer, e), buf[a : a + n])
        return written + sum(sizes)

    def _run_groups(self, layer: int, glu: SwitchGLU, x: mx.array, routed: np.ndarray,
                    ids: list[int], target: str) -> mx.array:
        """A call over more experts than the pool holds (or one that needs dummy rows to keep
        its kernel), group by group: half the pool a group, so one computes while the next is
        read; experts already held go first. Rows are ordered by group, then slot."""
        assert self.table is not None
        table = self.table
        size = max(1, self.capacity // 2) if len(ids) > self.capacity else len(ids)
        order = sorted(ids, key=lambda e: (layer, e) not in table)  # stable: held first
        group = np.zeros(max(ids) + 1, np.int64)
        group[np.asarray(order)] = np.arange(len(order)) // size
        flat = routed.reshape(-1)
        group_of_row = group[flat]
        k = routed.shape[-1]
        xs = mx.expand_dims(x, (-2, -3)).flatten(0, -3)  # [tokens, 1, D]
        outs, parts = [], []
        for g, start in enumerate(range(0, len(order), size)):
            slots = self.acquire(layer, order[start:start + size])
            rows = np.nonzero(group_of_row == g)[0]
            slot_of_row = _local(flat[rows], slots)
            by_slot = np.argsort(slot_of_row, kind="stable")
            rows, idx = rows[by_slot], slot_of_row[by_slot]
            y = self._project(glu, xs, rows, idx, k, target, routed.size)
            mx.async_eval(y)  # computes while the next group is read
            table.fence(slots.values(), y)
            outs.append(y)
            parts.append(rows)
        perm = np.concatenate(parts)
        inv = np.empty_like(perm)
        inv[perm] = np.arange(perm.size)
        y = mx.concatenate(outs, axis=0)[mx.array(inv)]
        return mx.unflatten(y, 0, routed.shape).squeeze(-2)

    def _project(self, glu: SwitchGLU, xs: mx.array, rows: np.ndarray, idx: np.ndarray, k: int,
                 target: str, call_rows: int) -> mx.array:
        """mlx-lm's SwitchGLU body on one group's rows (sorted by slot), padded with dummy rows
        (the last row again) where the resident kernel needs them; the dummies are dropped."""
        fit = self._fit(target, rows.size, call_rows)
        if fit.pad:
            rows = np.concatenate([rows, np.full(fit.pad, rows[-1])])
            idx = np.concatenate([idx, np.full(fit.pad, idx[-1], np.uint32)])
        x, ix = xs[mx.array(rows // k)], mx.array(idx)
        _allow_sorted(glu, fit.sorted)
        up = glu.up_proj(x, ix, sorted_indices=True)
        gate = glu.gate_proj(x, ix, sorted_indices=True)
        y = glu.down_proj(glu.activation(up, gate), ix, sorted_indices=True)
        self.stats.groups += 1
        return y[: rows.size - fit.pad] if fit.pad else y

    # a layer call on the device map (cachecd_engine.speculate) -------------------------------
    def ready_for_device(self) -> None:
        """Take in finished read-ahead and compute its derived arrays, so that every slot the
        device map names ready holds its expert whole."""
        self._sweep()
        self._derive_staged()

    def run_on_device(self, layer: int, glu: SwitchGLU, x: mx.array, indices: mx.array,
                      slot_of: mx.array) -> mx.array:
        """The call with its slots looked up on the device (``slot_of[expert]``): no read-back.
        Kept only if the host later finds every routed expert ready (``settle_device_calls``)."""
        from cachecd_engine.speculate import Missed

        t0 = time.perf_counter()
        target = dispatch.resident_kernel(self.backend, self.spec.mode is not None,
                                          indices.size, self.experts_per_layer)
        fit = self._fit(target, indices.size, indices.size)
        if fit.pad:  # dummy rows need the routing on the host
            raise Missed(f"layer {layer}: the resident kernel needs dummy rows here")
        _allow_sorted(glu, fit.sorted)
        y = glu(x, slot_of[indices])
        self.stats.plan_s += time.perf_counter() - t0
        return y

    def settle_device_calls(self, calls: list[tuple[int, np.ndarray, mx.array]]) -> bool:
        """After the read-back of a step run on the device map (which evaluated every queued
        reader): True, with each call counted and fenced as a layer call is, if every routed
        expert was in a ready slot; False (nothing counted) if any was not."""
        table = self.table
        assert table is not None
        table.clear_fences()
        distinct = [(layer, _distinct(routed)) for layer, routed, _ in calls]
        for layer, ids in distinct:
            for e in ids:
                slot = table.slot((layer, e))
                if slot is None or table.filling(slot):
                    return False
        s = self.stats
        for (layer, routed, y), (_, ids) in zip(calls, distinct, strict=True):
            slots = table.use(layer, ids)
            table.fence(slots.values(), y)
            s.layer_calls += 1
            s.groups += 1
            s.rows += routed.size
            s.experts_routed += len(ids)
            s.ram_hits += len(ids)
            self._guessed.difference_update((layer, e) for e in ids)
            if self.trace is not None:
                self.trace(layer, routed)
        return True

    def load_stack(self, layer: int, ids: list[int]) -> dict[str, dict[str, mx.array]]:
        """These experts in slots of the pool (read now where not held), and the pool's arrays,
        evaluated: what the kernel would read. For benches and checks; calls use ``run``."""
        self.acquire(layer, sorted(set(ids)))
        assert self.memory is not None
        return self.memory.arrays

    def drop(self, layer: int, ids: list[int]) -> None:
        """Forget these experts (benches: read them again next time)."""
        self.settle()
        if self.table is not None:
            self.table.forget([s for e in ids if (s := self.table.slot((layer, e))) is not None])

    def _nbytes(self, layer: int, expert: int) -> int:
        offset, n, _ = self.pieces(layer, expert)[-1]
        return offset + n

    def close(self) -> None:
        for slot in list(self._reads):
            self._reads[slot][1].cancel()
        self._readers.shutdown(wait=True, cancel_futures=True)


def _chunks(ids: list[int], size: int) -> list[list[int]]:
    size = max(1, size)
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _distinct(routed: np.ndarray) -> list[int]:
    if routed.size < _SMALL:
        return sorted(set(routed.ravel().tolist()))
    return np.unique(routed).tolist()


_SMALL = 64  # below this many rows (decode) plain Python beats numpy's per-call overhead


def _local(routed: np.ndarray, slots: dict[int, int]) -> np.ndarray:
    """``routed`` with each expert id replaced by its slot."""
    if routed.size < _SMALL:
        flat = [slots[e] for e in routed.ravel().tolist()]
        return np.array(flat, dtype=np.uint32).reshape(routed.shape)
    ids = np.fromiter(slots, np.int64, len(slots))
    lut = np.zeros(int(ids.max()) + 1, dtype=np.uint32)
    lut[ids] = np.fromiter(slots.values(), np.uint32, len(slots))
    return lut[routed]


def _allow_sorted(glu: SwitchGLU, flag: bool) -> None:
    for proj in ("gate_proj", "up_proj", "down_proj"):
        object.__setattr__(getattr(glu, proj), "_allow_sorted", flag)


