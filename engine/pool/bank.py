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
  are fences (set before the call is queued), evaluated with the next routing read-back
  (``synced``) or before their slots are refilled, and cleared only by the evaluation that
  included them; read-ahead never takes a fenced slot.
- No exception leaves a slot wrong: a miss is claimed, read, derived and only then marked
  ready, and any exception on the way frees every slot it claimed (``fill``).
- The computation is mlx-lm's own: its SwitchGLU when the call is whole, else its projections
  and activation group by group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from cachecd import errors
from cachecd_engine.formats import ExpertLayout, Piece, QuantSpec, StackLayout, pieces
from cachecd_engine.pool import dispatch
from cachecd_engine.pool.arrays import PoolMemory
from cachecd_engine.pool.calls import allow_sorted, distinct, local_slots, run_groups
from cachecd_engine.pool.chunks import ChunkBatch
from cachecd_engine.pool.fill import Filler
from cachecd_engine.pool.memory import PoolSizer
from cachecd_engine.pool.slots import DEFAULT_POLICY, Key, SlotTable

Targets = Sequence[Sequence[memoryview]]  # per expert, the buffers its bytes fill in order
MIN_SLOTS = 2  # one group computes while the next is read


class ExpertSource(Protocol):
    """Where expert bytes come from (the daemon client in production)."""

    def read_into(self, layer: int, ids: list[int], targets: Targets,
                  landed: Callable[[int, int], None] | None = None) -> int:
        """Read each expert's bytes into its targets (thread-safe: read-ahead uses threads);
        the bytes written, each expert's checked against its digest where the source checks
        (``DaemonSource.verify``) before this returns. ``landed(i, n)``, if given, is called on
        the caller's thread, in order, once the first ``n`` bytes of ``ids[i]`` are in place
        (``n`` grows and ends at the expert's size; the rest may still be being read; an expert
        read again after a failed check lands again from its start, ``n`` falling back)."""
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
    copied_bytes: int = 0  # bytes written: reads (into slots, or staging and the copy to the GPU),
    #                        derived arrays, resizes; a hit writes none
    staged: int = 0  # experts read ahead
    padded_rows: int = 0  # dummy rows added to keep the resident kernel (dispatch)
    windowed: int = 0  # calls gathered over a window of the pool as large as a layer (Metal)
    swapped: int = 0  # slots whose contents moved to bring a call within one window
    readback_s: float = 0.0  # blocked reading back the routing (it runs what came before)
    wait_s: float = 0.0  # blocked getting experts into slots: reads (demand, and read-ahead a
    #                      call needs), derived arrays
    readers_s: float = 0.0  # evaluating queued readers of slots about to be refilled (earlier
    #                         calls' compute, e.g. the previous group's)
    plan_s: float = 0.0  # the bank's own host work: the slot table and its policy, indices,
    #                      building the call

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
        self.sizer: PoolSizer | None = None  # set when the pool's size is the measured default
        self.speculator: Any = None  # cachecd_engine.pool.speculate.Speculator, when steps speculate
        # Set only by prefill.prefill around calls whose expert output nothing reads.
        self.discarding = False
        # Set only by prefill.prefill while a layer's chunks go through it together (``chunks``).
        self.chunks: ChunkBatch | None = None
        self.window_nbytes: int | None = None  # a window's outputs at most (None: prefill's default)
        self.min_slots = MIN_SLOTS  # the least a default-sized pool gets (the loader: 2 calls)
        self.max_slots = 0  # if set: the experts the model has (more slots would stay empty)
        # Read a decode call's misses while the model's thread builds the graph after it, up
        # to the next MoE layer's call (``fill.complete``); never for ``last_layers`` (the
        # last MoE layer of each forward, after which mlx-lm evaluates). Off by default:
        # bench/k3_decode.py's pc-defer case measures it beside pc.
        self.defer_reads = False
        self.last_layers: set[int] = set()
        self.fill = Filler(self, readers)

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
        self.pool(layer, 0)

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

    def pool(self, layer: int, expert: int) -> tuple[PoolMemory, SlotTable]:
        if self.memory is None or self.table is None:
            self.pieces(layer, expert)
            assert self.layout is not None
            slots = self._slots_for(self.pool_bytes)
            self.memory = PoolMemory(self.spec, self.layout, slots, self.backend)
            self.table = SlotTable(slots, self.policy, self.experts_per_layer)
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
        slots, so nothing already local is read again; every output stays the same. The pool
        is rebuilt one tensor at a time (``PoolMemory.resize``), never old and new at once:
        the layers' modules let go of the old arrays first (a placeholder each), then take the
        new ones. On CUDA the slots move by the copy engine (the filler's copier). A resize
        that fails part way (an allocation refused) drops the pool: every output stays the
        same, what it held is read again."""
        self.pool_bytes = pool_bytes
        if self.memory is None or self.table is None:
            return
        slots = self._slots_for(pool_bytes)
        if slots == self.table.capacity:
            return
        self.settle()
        moves = self.table.resize(slots)
        placeholder = mx.zeros((0,), mx.uint8)
        for glu in self._templates:
            for proj, arrays in self.memory.arrays.items():
                for name in arrays:
                    setattr(getattr(glu, proj), name, placeholder)
        try:
            self.stats.copied_bytes += self.memory.resize(slots, moves, self.fill.copier)
        except BaseException:
            # Some tensors have the new size and some the old: nothing in the pool can be used.
            # The next call allocates it anew (empty) and reads again what it needs.
            self.memory = self.table = None
            raise
        for glu in self._templates:
            self._hold(glu)

    def settle(self) -> None:
        """Finish every read under way and evaluate every queued reader of a slot."""
        self.fill.complete()
        self.fill.finish_all()
        self.fill.derive_staged()
        if self.table is not None:
            fenced = self.table.fenced()
            if fenced:
                mx.eval(fenced)
                self.table.clear_fences(fenced)

    def prefill_at(self, layer: int | None) -> None:
        """A layer-major prefill is at ``layer`` (None: it ended): the pool gives up the
        experts of the layers before it first, and this layer's last (``SlotTable``)."""
        if self.table is not None:
            self.table.prefill_layer = layer

    def groups_chunks(self) -> bool:
        """Whether a prefill pass should take a layer's chunks together (``chunks``): only
        where the pool holds fewer experts than a layer has (otherwise each is read once
        already, and the chunks' second pass through the layer would be work for nothing)."""
        return self.table is not None and 0 < self.capacity < self.experts_per_layer

    def holds(self, layer: int, expert: int) -> bool:
        return self.table is not None and (layer, expert) in self.table

    def fenced(self) -> list[mx.array]:
        """The outputs of queued calls that read slots (evaluate them with the read-back); a
        deferred read those calls wait on is completed first."""
        self.fill.complete()
        return self.table.fenced() if self.table is not None else []

    def synced(self, evaluated: list[mx.array]) -> None:
        """The outputs ``fenced`` returned (``evaluated``) have been evaluated (a routing
        read-back): no queued work reads their slots. A default-sized pool is measured again
        here now and then."""
        if self.table is not None:
            self.table.clear_fences(evaluated)
        if self.sizer is not None and self.sizer.due() and self.memory is not None:
            want = self.sizer.target(self.memory.nbytes)
            if want is not None:
                self.resize(want)

    # a layer call ----------------------------------------------------------------------------
    def run(self, layer: int, glu: SwitchGLU, x: mx.array, routed: np.ndarray) -> mx.array:
        """The layer's expert output for ``x`` routed to ``routed`` (mlx-lm's shapes)."""
        t0 = time.perf_counter()
        ids = distinct(routed)
        s = self.stats
        s.layer_calls += 1
        s.rows += routed.size
        s.experts_routed += len(ids)
        _, table = self.pool(layer, ids[0])
        target = dispatch.resident_kernel(self.backend, self.spec.mode is not None, routed.size,
                                          self.experts_per_layer or len(ids))
        whole = len(ids) <= table.capacity
        fit = self.fit(target, routed.size, routed.size) if whole else None
        s.plan_s += time.perf_counter() - t0
        span = dispatch.window(self.backend, table.capacity, self.experts_per_layer)
        if fit is not None and fit.pad and span is not None:
            return self._run_windowed(layer, glu, x, routed, ids, target, span)
        if fit is None or fit.pad:
            return run_groups(self, layer, glu, x, routed, ids, target)
        slots = self.fill.acquire(layer, ids, defer=self._may_defer(layer))
        t1 = time.perf_counter()
        allow_sorted(glu, fit.sorted)
        y = glu(x, mx.array(local_slots(routed, slots)))
        table.fence(slots.values(), y)  # before it is queued: nothing may run unfenced
        if not self.fill.deferred:  # else queued by the next read-back, after ``complete``
            mx.async_eval(y)
        s.groups += 1
        s.plan_s += time.perf_counter() - t1
        return y

    def _may_defer(self, layer: int) -> bool:
        """Whether this call's misses may be read while the model's thread goes on building
        the graph (``defer_reads``): a decode call of a layer with another MoE layer after it
        in this forward (whose call completes the read before any evaluation), outside
        prefill passes."""
        return (self.defer_reads and layer not in self.last_layers and self.chunks is None
                and not self.discarding and self.table is not None
                and self.table.prefill_layer is None)

    def _run_windowed(self, layer: int, glu: SwitchGLU, x: mx.array, routed: np.ndarray,
                      ids: list[int], target: str, span: int) -> mx.array:
        """A call over a window of ``span`` slots (``dispatch.window``): its experts brought
        within one window by swapping slots, then gathered over that slice of the pool."""
        slots = self.acquire(layer, ids)
        t1 = time.perf_counter()
        start = self._gather_into_window(slots, span)
        fit = dispatch.fit(self.backend, self.spec.mode is not None, target, routed.size, span,
                           routed.size >= dispatch.SORT_ROWS)
        if start is None or fit.pad:  # a read-ahead in the way: the call as before
            self.stats.plan_s += time.perf_counter() - t1
            return run_groups(self, layer, glu, x, routed, ids, target)
        assert self.memory is not None and self.table is not None
        local = {e: s - start for e, s in slots.items()}
        try:
            for proj, arrays in self.memory.arrays.items():
                module = getattr(glu, proj)
                for name, arr in arrays.items():
                    setattr(module, name, arr[start:start + span])  # a view: no copy
            allow_sorted(glu, fit.sorted)
            y = glu(x, mx.array(local_slots(routed, local)))
        finally:
            self._hold(glu)
        self.table.fence(slots.values(), y)
        mx.async_eval(y)
        self.stats.groups += 1
        self.stats.windowed += 1
        self.stats.plan_s += time.perf_counter() - t1
        return y

    def _gather_into_window(self, slots: dict[int, int], span: int) -> int | None:
        """The start of a window of ``span`` slots holding every slot of ``slots`` (updated in
        place), after swapping the ones outside with slots inside that this call does not use
        (their queued readers evaluated first); None if slots being read ahead are in the way."""
        assert self.memory is not None and self.table is not None
        table, used = self.table, sorted(slots.values())
        best, lo = (0, 0), 0
        for hi in range(len(used)):  # the window holding the most of the call's slots
            while used[hi] - used[lo] >= span:
                lo += 1
            if hi - lo + 1 > best[0]:
                best = (hi - lo + 1, used[lo])
        start = min(best[1], table.capacity - span)
        inside = set(range(start, start + span))
        out = [s for s in used if s not in inside]
        if not out:
            return start
        mine = set(used)
        spare = [s for s in range(start, start + span) if s not in mine and not table.filling(s)]
        if len(spare) < len(out):
            return None
        pairs = list(zip(out, spare, strict=False))
        fences = table.fences_of([s for pair in pairs for s in pair])
        if fences:
            t0 = time.perf_counter()
            mx.eval(fences)
            table.clear_fences(fences)
            self.stats.readers_s += time.perf_counter() - t0
        table.swap(pairs)
        self.stats.copied_bytes += self.memory.swap(pairs)
        self.stats.swapped += len(pairs)
        moved = dict(pairs)
        for e, s in slots.items():
            slots[e] = moved.get(s, s)
        return start

    def fit(self, target: str, rows: int, call_rows: int) -> dispatch.Fit:
        """How ``rows`` rows of a call over ``call_rows`` reach ``target`` with the pool as the
        stack (the sorted flag may be set only where mlx-lm sorts the call's rows)."""
        return dispatch.fit(self.backend, self.spec.mode is not None, target, rows,
                            self.capacity, call_rows >= dispatch.SORT_ROWS)

    def acquire(self, layer: int, ids: list[int]) -> dict[int, int]:
        """Every expert of ``ids`` in a slot, bytes in place: expert -> slot (``fill``)."""
        return self.fill.acquire(layer, ids)

    def stage(self, layer: int, guess: list[int]) -> None:
        """Read the guessed experts of ``layer`` no slot holds into free slots, ahead."""
        self.fill.stage(layer, guess)

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

    def nbytes(self, layer: int, expert: int) -> int:
        offset, n, _ = self.pieces(layer, expert)[-1]
        return offset + n

    def close(self) -> None:
        self.fill.close()
