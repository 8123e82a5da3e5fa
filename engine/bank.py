"""The expert bank: a layer call's routed experts into the stack the kernel reads, and the call.

Invariants (the bit-identity argument):
- Every routed expert is used; none is skipped, pruned or approximated.
- The stack holds the routed experts' bytes as the checkpoint has them, in arrays of the same
  dtype and layout as the resident stack; every row meets the same weights as in the resident
  model. Slots are in ascending expert order (indices remapped monotonically), except in a call
  too small for mlx-lm to sort its rows, where experts read ahead into the stack keep the slot
  they were read into: such a call gathers its rows in their own order whatever the slots are.
- Every gather reaches the kernel the resident call reaches on this backend (``dispatch``): the
  ``sorted_indices`` flag and, for groups, dummy rows, are set so. A call routing to more experts
  than the stack buffer holds runs in groups of experts; each row is computed by the same kernel
  from the same input and weights, and the outputs are put back in the resident order.
- The computation is mlx-lm's own: its SwitchGLU when the call fits one stack, else its
  projections and activation group by group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU

from cachecd_engine import dispatch
from cachecd_engine.arena import StackArena, StackBuffer
from cachecd_engine.formats import (
    ExpertLayout,
    Piece,
    QuantSpec,
    StackLayout,
    expert_memory_nbytes,
    finish,
    pieces,
)
from cachecd_engine.ram_tier import RamTier

Targets = Sequence[Sequence[memoryview]]  # per expert, the buffers its bytes fill in order


class ExpertSource(Protocol):
    """Where expert bytes come from (the daemon client in production)."""

    def read_into(self, layer: int, ids: list[int], targets: Targets) -> None:
        """Read each expert's bytes into its targets (thread-safe: read-ahead uses threads)."""
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
    groups: int = 0  # stack fills (one per call unless a call is split by the memory bound)
    rows: int = 0  # routed (token, slot) pairs
    experts_routed: int = 0  # distinct experts per layer call, summed
    ram_hits: int = 0
    staged_hits: int = 0  # routed experts already read ahead from the guess
    source_hits: int = 0  # experts read from the source on demand
    source_bytes: int = 0  # bytes read from the source (demand and read-ahead)
    copied_bytes: int = 0  # bytes copied into stacks and into the RAM tier
    staged: int = 0  # experts read ahead
    readback_s: float = 0.0  # blocked reading back the routing (it runs what came before)
    wait_s: float = 0.0  # blocked getting experts into the stack (not hidden behind compute)
    plan_s: float = 0.0  # remapping, planning and building the arrays

    def reset(self) -> None:
        for name, value in asdict(EngineStats()).items():
            setattr(self, name, value)

    def snapshot(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class Staged:
    """Experts of one layer read ahead into a stack buffer, and their reads."""

    layer: int
    buffer: StackBuffer
    slots: dict[int, int]  # expert -> slot
    reads: dict[int, Future[None]] = field(default_factory=dict)


class ExpertBank:
    """Gets a layer call's experts into the stack the kernel reads, and runs the call.

    Args:
        source: expert bytes (the daemon in production).
        spec: the quantization the resident model uses for the experts.
        ram: the RAM tier of hot experts.
        expert_memory: bytes the stack buffers may take together (the prefill memory bound).
        experts_per_layer: experts in the resident stack of a layer (for the kernel decision).
    """

    def __init__(self, source: ExpertSource, spec: QuantSpec, ram: RamTier,
                 stats: EngineStats | None = None, *, expert_memory: int = 4 << 30,
                 experts_per_layer: int = 0, readers: int = 2) -> None:
        self.source = source
        self.spec = spec
        self.ram = ram
        self.stats = stats or EngineStats()
        self.expert_memory = expert_memory
        self.experts_per_layer = experts_per_layer
        self.backend = dispatch.current_backend()
        # Optional observer called with (layer, routed ids) once per layer call (engine.trace).
        self.trace: Callable[[int, np.ndarray], None] | None = None
        self.arena: StackArena | None = None
        self._pieces: dict[tuple[int, int], tuple[Piece, ...]] = {}
        self._staged: Staged | None = None
        self._straggling: list[Future[None]] = []  # unwanted read-ahead still running
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="cachecd-ahead")

    # layout ----------------------------------------------------------------------------------
    def pieces(self, layer: int, expert: int) -> tuple[Piece, ...]:
        key = (layer, expert)
        got = self._pieces.get(key)
        if got is None:
            entry = self.source.entry(layer, expert)
            if self.arena is None:
                layout = StackLayout.of(entry)
                cost = expert_memory_nbytes(self.spec, layout, self.backend)
                self.arena = StackArena(layout, self.expert_memory, cost)
            got = self._pieces[key] = pieces(entry, self.arena.layout)
        return got

    def prepare(self, layer: int) -> None:
        """Read the expert layout from the manifest and size the stack buffers now."""
        self._arena(layer, 0)

    def _arena(self, layer: int, expert: int) -> StackArena:
        self.pieces(layer, expert)
        assert self.arena is not None
        return self.arena

    # read-ahead ------------------------------------------------------------------------------
    def stage(self, layer: int, guess: list[int], room: int) -> None:
        """Start getting the guessed experts of ``layer`` into the stack buffer its call will use
        (read from the source, or copied from the RAM tier), in the background, keeping ``room``
        slots free for the experts the guess misses."""
        self.drop_staged()
        arena = self._arena(layer, guess[0]) if guess else None
        if arena is None or arena.capacity - room < 1:
            return
        guess = guess[: arena.capacity - room]
        buf = arena.peek()
        buf.settle()
        buf.reserve(len(guess) + room)
        held = self.ram.peek(layer, guess)
        staged = Staged(layer, buf, {e: i for i, e in enumerate(guess)})
        for e, slot in staged.slots.items():
            p = self.pieces(layer, e)
            if e in held:
                fut = self._readers.submit(buf.fill, slot, p, held[e])
            else:
                fut = self._readers.submit(self._read, layer, [e], [buf.targets(slot, p)])
            staged.reads[e] = fut
            buf.track(fut)
        self._staged = staged
        self.stats.staged += len(guess)

    def _read(self, layer: int, ids: list[int], targets: Targets) -> None:
        self.source.read_into(layer, ids, targets)

    def drop_staged(self) -> None:
        """Forget a read-ahead no call used (its reads finish before its buffer is refilled)."""
        staged, self._staged = self._staged, None
        if staged is not None:
            self._cancel(staged, set())

    def _cancel(self, staged: Staged, keep: set[int]) -> dict[int, Future[None]]:
        """Cancel the read-ahead of experts not in ``keep``, and return the reads of those in
        it. Copies already under way may still read RAM-tier blobs: the tier evicts nothing
        until they are done (``_admit``)."""
        kept = {}
        for e, fut in staged.reads.items():
            if e in keep:
                kept[e] = fut
            elif not fut.cancel():
                self._straggling.append(fut)
        return kept

    # a layer call ----------------------------------------------------------------------------
    def run(self, layer: int, glu: SwitchGLU, x: mx.array, routed: np.ndarray) -> mx.array:
        """The layer's expert output for ``x`` routed to ``routed`` (mlx-lm's shapes)."""
        t0 = time.perf_counter()
        ids = np.unique(routed).tolist()
        self.stats.layer_calls += 1
        self.stats.rows += routed.size
        self.stats.experts_routed += len(ids)
        arena = self._arena(layer, ids[0])
        staged = self._staged if self._staged is not None and self._staged.layer == layer else None
        if staged is None:
            self.drop_staged()
        self._staged = None
        order = ids
        if staged is not None:
            slots = dict(staged.slots)
            for e in ids:
                slots.setdefault(e, len(slots))
            # Sorted calls need ascending slots; a call too big, or a buffer that is not next
            # (something else ran in between), starts over.
            if (routed.size >= dispatch.SORT_ROWS or len(slots) > arena.capacity
                    or staged.buffer is not arena.peek()):
                self._cancel(staged, set())
                staged = None
            else:
                order = sorted(slots, key=slots.__getitem__)
        groups = dispatch.plan_groups(self.backend, self.spec.mode is not None,
                                      _counts(routed, order), arena.capacity,
                                      self.experts_per_layer or len(order))
        self.stats.plan_s += time.perf_counter() - t0
        if len(groups) > 1:
            return self._run_groups(layer, glu, x, routed, ids, groups)
        buf = arena.next()  # the staged buffer, when there is one
        if staged is None:
            buf.settle()
        self._fill(layer, buf, order, staged, set(ids))
        t1 = time.perf_counter()
        y = self._compute_whole(glu, buf, len(order), x, _local(routed, order), groups[0].fit)
        buf.guard(y)
        self.stats.plan_s += time.perf_counter() - t1
        self._admit(layer, buf, order, set(ids))
        return y

    def _fill(self, layer: int, buf: StackBuffer, order: list[int], staged: Staged | None,
              routed: set[int]) -> None:
        """Every routed expert into its slot of ``buf``: already there (read ahead), copied from
        the RAM tier, or read from the source now. Read-ahead the routing did not want is
        dropped; a failed one is read again now (which raises if it fails again)."""
        t0 = time.perf_counter()
        buf.reserve(len(order))
        slot_of = {e: i for i, e in enumerate(order)}
        ahead = self._cancel(staged, routed) if staged is not None else {}
        wanted = [e for e in order if e in routed]
        found = self.ram.lookup(layer, wanted)  # counts each routed expert's use once
        copies = [
            self._readers.submit(buf.fill, slot_of[e], self.pieces(layer, e), blob)
            for e, blob in found.items()
            if e not in ahead
        ]
        for fut in copies:  # if a read below fails, the buffer still waits for these
            buf.track(fut)
        self._read_now(layer, buf, slot_of, [e for e in wanted if e not in found and e not in ahead])
        again = [e for e, fut in ahead.items() if fut.exception() is not None]
        self._read_now(layer, buf, slot_of, again)
        for fut in copies:
            fut.result()
        self.stats.ram_hits += len(found)
        self.stats.staged_hits += len(ahead) - len(again)
        self.stats.copied_bytes += sum(blob.size for blob in found.values())
        self.stats.source_bytes += sum(self._nbytes(layer, e) for e in ahead
                                       if e not in found and e not in again)
        self.stats.groups += 1
        self.stats.wait_s += time.perf_counter() - t0

    def _read_now(self, layer: int, buf: StackBuffer, slot_of: dict[int, int],
                  ids: list[int]) -> None:
        if not ids:
            return
        targets = [buf.targets(slot_of[e], self.pieces(layer, e)) for e in ids]
        self.source.read_into(layer, ids, targets)
        self.stats.source_hits += len(ids)
        self.stats.source_bytes += sum(self._nbytes(layer, e) for e in ids)

    def load_stack(self, layer: int, ids: list[int]) -> dict[str, dict[str, mx.array]]:
        """The stack of these experts (ascending ids), evaluated, as a layer call builds it: what
        the kernel would read. For benches and checks; calls use ``run``."""
        ids = sorted(set(ids))
        arena = self._arena(layer, ids[0])
        buf = arena.next()
        buf.settle()
        self._fill(layer, buf, ids, None, set(ids))
        arrays = self._arrays(buf, len(ids))
        mx.eval([a for proj in arrays.values() for a in proj.values()])
        return arrays

    def _nbytes(self, layer: int, expert: int) -> int:
        offset, n, _ = self.pieces(layer, expert)[-1]
        return offset + n

    def _arrays(self, buf: StackBuffer, n: int) -> dict[str, dict[str, mx.array]]:
        assert self.arena is not None
        return finish(self.spec, self.arena.layout, buf.stacks(n))

    def _compute_whole(self, glu: SwitchGLU, buf: StackBuffer, n: int, x: mx.array,
                       local: np.ndarray, fit: dispatch.Fit) -> mx.array:
        assert fit.pad == 0, "a call over all its rows never needs dummy rows"
        with _loaded(glu, self._arrays(buf, n), fit.sorted):
            y = glu(x, mx.array(local))
        mx.async_eval(y)
        return y

    def _run_groups(self, layer: int, glu: SwitchGLU, x: mx.array, routed: np.ndarray,
                    ids: list[int], groups: list[dispatch.Group]) -> mx.array:
        """A call over more experts than one stack holds, group by group (rows sorted by
        expert, so each group's rows are one slice)."""
        assert self.arena is not None
        flat = routed.reshape(-1)
        local = np.searchsorted(np.asarray(ids), flat).astype(np.uint32)
        row_order = np.argsort(local, kind="stable")
        inv = np.empty_like(row_order)
        inv[row_order] = np.arange(row_order.size)
        k = routed.shape[-1]
        xs = mx.expand_dims(x, (-2, -3)).flatten(0, -3)  # [tokens, 1, D]
        outs = []
        pos = 0
        for g in groups:
            buf = self.arena.next()
            buf.settle()
            members = ids[g.start:g.stop]
            self._fill(layer, buf, members, None, set(members))
            rows = row_order[pos:pos + g.rows]
            pos += g.rows
            idx = local[rows] - g.start
            if g.fit.pad:
                rows = np.concatenate([rows, np.full(g.fit.pad, rows[-1])])
                idx = np.concatenate([idx, np.full(g.fit.pad, g.stop - g.start - 1, np.uint32)])
            y = self._project(glu, buf, len(members), xs[mx.array(rows // k)], mx.array(idx),
                              g.fit.sorted)
            y = y[: g.rows] if g.fit.pad else y
            mx.async_eval(y)  # computes while the next group is read into the other buffer
            buf.guard(y)
            self._admit(layer, buf, members, set(members))
            outs.append(y)
        y = mx.concatenate(outs, axis=0)[mx.array(inv)]
        return mx.unflatten(y, 0, routed.shape).squeeze(-2)

    def _project(self, glu: SwitchGLU, buf: StackBuffer, n: int, x: mx.array, idx: mx.array,
                 sorted_flag: bool) -> mx.array:
        # mlx-lm's SwitchGLU body on rows already gathered and sorted by expert.
        with _loaded(glu, self._arrays(buf, n), sorted_flag):
            up = glu.up_proj(x, idx, sorted_indices=True)
            gate = glu.gate_proj(x, idx, sorted_indices=True)
            return glu.down_proj(glu.activation(up, gate), idx, sorted_indices=True)

    def _admit(self, layer: int, buf: StackBuffer, order: list[int], routed: set[int]) -> None:
        """Copy experts read from the source into the RAM tier, if it keeps them (after the
        kernel has its stack: the copy runs beside the compute)."""
        straggling, self._straggling = self._straggling, []
        for fut in straggling:
            fut.exception()  # waits: it may be copying a blob the tier is about to evict
        if self.ram.budget == 0:
            return
        for slot, e in enumerate(order):
            if e not in routed or (layer, e) in self.ram:
                continue
            p = self.pieces(layer, e)
            blob = self.ram.admit(layer, e, self._nbytes(layer, e))
            if blob is not None:
                buf.copy_out(slot, p, blob)
                self.stats.copied_bytes += blob.size

    def close(self) -> None:
        self.drop_staged()
        self._readers.shutdown(wait=True, cancel_futures=True)


def _counts(routed: np.ndarray, order: list[int]) -> list[int]:
    c = np.bincount(routed.reshape(-1), minlength=max(order) + 1)
    return [int(c[e]) for e in order]


_SMALL = 64  # below this many rows (decode) plain Python beats numpy's per-call overhead


def _local(routed: np.ndarray, order: list[int]) -> np.ndarray:
    """``routed`` with each expert id replaced by its slot in ``order``."""
    if routed.size < _SMALL:
        pos = {e: i for i, e in enumerate(order)}
        flat = [pos[e] for e in routed.ravel().tolist()]
        return np.array(flat, dtype=routed.dtype).reshape(routed.shape)
    lut = np.zeros(max(order) + 1, dtype=routed.dtype)
    lut[np.asarray(order)] = np.arange(len(order), dtype=routed.dtype)
    return lut[routed]


def remap(routed: np.ndarray) -> tuple[list[int], np.ndarray]:
    """(distinct experts ascending, indices replaced by their position in that list)."""
    ids = np.unique(routed).tolist()
    return ids, _local(routed, ids)


class _loaded:
    """The template's projections hold this stack (and the sorted flag) for one call."""

    def __init__(self, glu: SwitchGLU, arrays: dict[str, dict[str, mx.array]],
                 sorted_flag: bool) -> None:
        self.glu, self.arrays, self.sorted_flag = glu, arrays, sorted_flag

    def __enter__(self) -> None:
        for proj, arrays in self.arrays.items():
            module = getattr(self.glu, proj)
            for name, arr in arrays.items():
                setattr(module, name, arr)
            object.__setattr__(module, "_allow_sorted", self.sorted_flag)

    def __exit__(self, *exc: object) -> None:
        for proj in self.arrays:
            _release(getattr(self.glu, proj))


_EMPTY = mx.zeros((0,), dtype=mx.uint8)


def _release(proj: nn.Module) -> None:
    # Drop the call's stacks now rather than when the next call overwrites them.
    for name in ("weight", "scales", "biases"):
        if name in proj and proj[name] is not None:
            proj[name] = _EMPTY
