"""Building a layer call's gather over the pool: each row's slot, the sorted flag, and a call
over more experts than the pool holds, group by group.

Invariants (with ``bank``'s): each group's experts are in slots before its rows are computed;
a group's slots are refilled for a later group only after its output is evaluated (its
output fences them); every row meets the kernel the resident call takes, with dummy rows where
``dispatch`` asks for them (dropped after); the outputs go back in the resident row order.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

# The bank is passed in as ``Any``: it imports this module, so this one may not import it back.
ExpertBank = Any


def run_groups(bank: ExpertBank, layer: int, glu: SwitchGLU, x: mx.array, routed: np.ndarray,
               ids: list[int], target: str) -> mx.array:
    """A call over more experts than the pool holds (or one that needs dummy rows to keep
    its kernel), group by group: half the pool a group, so one computes while the next is
    read; experts already held go first. Rows are ordered by group, then slot."""
    assert bank.table is not None
    table = bank.table
    size = max(1, bank.capacity // 2) if len(ids) > bank.capacity else len(ids)
    order = sorted(ids, key=lambda e: (layer, e) not in table)  # stable: held first
    group = np.zeros(max(ids) + 1, np.int64)
    group[np.asarray(order)] = np.arange(len(order)) // size
    flat = routed.reshape(-1)
    group_of_row = group[flat]
    k = routed.shape[-1]
    xs = mx.expand_dims(x, (-2, -3)).flatten(0, -3)  # [tokens, 1, D]
    outs, parts = [], []
    for g, start in enumerate(range(0, len(order), size)):
        slots = bank.acquire(layer, order[start:start + size])
        rows = np.nonzero(group_of_row == g)[0]
        slot_of_row = local_slots(flat[rows], slots)
        by_slot = np.argsort(slot_of_row, kind="stable")
        rows, idx = rows[by_slot], slot_of_row[by_slot]
        y = _project(bank, glu, xs, rows, idx, k, target, routed.size)
        mx.async_eval(y)  # computes while the next group is read
        table.fence(slots.values(), y)
        outs.append(y)
        parts.append(rows)
    perm = np.concatenate(parts)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    y = mx.concatenate(outs, axis=0)[mx.array(inv)]
    return mx.unflatten(y, 0, routed.shape).squeeze(-2)


def _project(bank: ExpertBank, glu: SwitchGLU, xs: mx.array, rows: np.ndarray,
             idx: np.ndarray, k: int, target: str, call_rows: int) -> mx.array:
    """mlx-lm's SwitchGLU body on one group's rows (sorted by slot), padded with dummy rows
    (the last row again) where the resident kernel needs them; the dummies are dropped."""
    fit = bank.fit(target, rows.size, call_rows)
    if fit.pad:
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
