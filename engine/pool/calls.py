"""Building a layer call's gather over the pool: each row's slot, the sorted flag, and a call
over more experts than the pool holds, group by group.

Invariants (with ``bank``'s): each group's experts are in slots before its rows are computed;
a group's slots are refilled for a later group only after its output is evaluated (its
output fences them); every row meets the kernel the resident call takes, with dummy rows where
``dispatch`` asks for them (dropped after); the outputs go back in the resident row order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

# The bank is passed in as ``Any``: it imports this module, so this one may not import it back.
ExpertBank = Any


@dataclass
class Call:
    """One layer call's rows: mlx-lm's ``switch_mlp(x, indices)`` with the routing read back."""

    glu: SwitchGLU
    x: mx.array
    routed: np.ndarray
    target: str  # the kernel the resident call takes (``dispatch.resident_kernel``)


def run_groups(bank: ExpertBank, layer: int, glu: SwitchGLU, x: mx.array, routed: np.ndarray,
               ids: list[int], target: str) -> mx.array:
    """A call over more experts than the pool holds (or one that needs dummy rows to keep
    its kernel), group by group (``run_calls``)."""
    return run_calls(bank, layer, [Call(glu, x, routed, target)], ids)[0]


def run_calls(bank: ExpertBank, layer: int, calls: list[Call], ids: list[int]) -> list[mx.array]:
    """Calls of one layer (one, or every prefill chunk's) over the experts ``ids`` they route
    to, group by group: half the pool a group when ``ids`` do not fit, so one computes while
    the next is read; experts already held go first. Each group is read once for all the
    calls' rows; within a call, rows are ordered by group, then slot, and put back after."""
    assert bank.table is not None
    table = bank.table
    size = max(1, bank.capacity // 2) if len(ids) > bank.capacity else len(ids)
    order = sorted(ids, key=lambda e: (layer, e) not in table)  # stable: held first
    group = np.zeros(max(ids) + 1, np.int64)
    group[np.asarray(order)] = np.arange(len(order)) // size
    flats = [c.routed.reshape(-1) for c in calls]
    group_of_rows = [group[flat] for flat in flats]
    xss = [mx.expand_dims(c.x, (-2, -3)).flatten(0, -3) for c in calls]  # [tokens, 1, D]
    outs: list[list[mx.array]] = [[] for _ in calls]
    parts: list[list[np.ndarray]] = [[] for _ in calls]
    for g, start in enumerate(range(0, len(order), size)):
        slots = bank.acquire(layer, order[start:start + size])
        ys = []
        for j, c in enumerate(calls):
            rows = np.nonzero(group_of_rows[j] == g)[0]
            if rows.size == 0:
                continue
            slot_of_row = local_slots(flats[j][rows], slots)
            by_slot = np.argsort(slot_of_row, kind="stable")
            rows, idx = rows[by_slot], slot_of_row[by_slot]
            y = _project(bank, c.glu, xss[j], rows, idx, c.routed.shape[-1], c.target,
                         c.routed.size)
            outs[j].append(y)
            parts[j].append(rows)
            ys.append(y)
        table.fence(slots.values(), ys)  # before they are queued: nothing runs unfenced
        mx.async_eval(ys)  # computes while the next group is read
    return [_assemble(o, p, c.routed.shape) for o, p, c in zip(outs, parts, calls, strict=True)]


def _assemble(outs: list[mx.array], parts: list[np.ndarray], shape: tuple[int, ...]) -> mx.array:
    """A call's group outputs back in the resident row order and shape."""
    perm = np.concatenate(parts)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    y = mx.concatenate(outs, axis=0)[mx.array(inv)]
    return mx.unflatten(y, 0, shape).squeeze(-2)


def _project(bank: ExpertBank, glu: SwitchGLU, xs: mx.array, rows: np.ndarray,
             idx: np.ndarray, k: int, target: str, call_rows: int) -> mx.array:
    """mlx-lm's SwitchGLU body on one group's rows (sorted by slot), padded with dummy rows
    (the last row again) where the resident kernel needs them; the dummies are dropped."""
    fit = bank.fit(target, rows.size, call_rows)
    if fit.pad:
        bank.stats.padded_rows += fit.pad
        rows = np.concatenate([rows, np.full(fit.pad, rows[-1])])
        idx = np.concatenate([idx, np.full(fit.pad, idx[-1], np.uint32)])
    x, ix = xs[mx.array(rows // k)], mx.array(idx)
    allow_sorted(glu, fit.sorted)
    up = glu.up_proj(x, ix, sorted_indices=True)
    gate = glu.gate_proj(x, ix, sorted_indices=True)
    y = glu.down_proj(glu.activation(up, gate), ix, sorted_indices=True)
    bank.stats.groups += 1
    return y[: rows.size - fit.pad] if fit.pad else y


def distinct(routed: np.ndarray) -> list[int]:
    if routed.size < _SMALL:
        return sorted(set(routed.ravel().tolist()))
    return np.unique(routed).tolist()


_SMALL = 64  # below this many rows (decode) plain Python beats numpy's per-call overhead


def local_slots(routed: np.ndarray, slots: dict[int, int]) -> np.ndarray:
    """``routed`` with each expert id replaced by its slot."""
    if routed.size < _SMALL:
        flat = [slots[e] for e in routed.ravel().tolist()]
        return np.array(flat, dtype=np.uint32).reshape(routed.shape)
    ids = np.fromiter(slots, np.int64, len(slots))
    lut = np.zeros(int(ids.max()) + 1, dtype=np.uint32)
    lut[ids] = np.fromiter(slots.values(), np.uint32, len(slots))
    return lut[routed]


def allow_sorted(glu: SwitchGLU, flag: bool) -> None:
    for proj in ("gate_proj", "up_proj", "down_proj"):
        object.__setattr__(getattr(glu, proj), "_allow_sorted", flag)
