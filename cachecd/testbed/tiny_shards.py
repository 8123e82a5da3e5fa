"""How a checkpoint's tensors are cut into shards, the way HF's sharding does it.

Invariants:
- Tensors are taken in name order; a shard is closed when the next tensor would take it past
  ``shard_bytes`` (a tensor larger than that gets a shard of its own). Cuts fall only between
  tensors, never inside one.
- Shard files are named model-0000i-of-0000n.safetensors (1-based, five digits).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from cachecd.errors import InvalidRequest
from cachecd.manifest.dtypes import DTYPES
from cachecd.testbed.tiny_config import TensorDef

_EXPERT_RE = re.compile(r"\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.")


def tensor_bytes(t: TensorDef) -> int:
    return DTYPES[t.dtype].itemsize * math.prod(t.shape)


@dataclass(frozen=True)
class ShardPlan:
    shards: list[list[TensorDef]]
    file_names: list[str]
    total_size: int


def plan_shards(defs: list[TensorDef], shard_bytes: int) -> ShardPlan:
    if shard_bytes <= 0:
        raise InvalidRequest(f"shard_bytes={shard_bytes} must be positive")
    shards: list[list[TensorDef]] = [[]]
    size = 0
    for t in sorted(defs, key=lambda d: d.name):
        nbytes = tensor_bytes(t)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    n = len(shards)
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    return ShardPlan(shards=shards, file_names=names, total_size=sum(tensor_bytes(t) for t in defs))


def expert_of(name: str) -> tuple[int, int] | None:
    """(layer, expert) of a routed expert's tensor name, or None for any other tensor."""
    m = _EXPERT_RE.search(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def split_experts(plan: ShardPlan) -> list[tuple[int, int]]:
    """The (layer, expert) pairs whose tensors lie in more than one shard, sorted."""
    homes: dict[tuple[int, int], set[int]] = {}
    for i, shard in enumerate(plan.shards):
        for t in shard:
            key = expert_of(t.name)
            if key is not None:
                homes.setdefault(key, set()).add(i)
    return sorted(k for k, v in homes.items() if len(v) > 1)
