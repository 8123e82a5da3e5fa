"""Several machines: which layers a pipeline rank runs, asked of mlx-lm's own ``pipeline``.

mlx-lm splits a model's layers over the ranks of an ``mx.distributed`` group
(``model.model.pipeline(group)``, rank 0 the last layers) and ``mlx.launch`` starts the ranks;
each rank streams only its own layers' experts, through its own daemon.

Invariants:
- A rank's layers come from mlx-lm's pipeline code itself: its model class (as ``load_model``
  picks it) built as a lazy skeleton, split with a stand-in group of that rank and size. Setup
  (what to install and register) and the engine (what to run) ask the same code, so they agree.
- Every rank keeps the tensors outside the layers (embeddings, final norm, head), as mlx-lm's
  ``sharded_load`` does: each rank all-gathers the last hidden state and computes the logits.
  A tensor's layer is read with ``sharded_load``'s own rule (``layers.N.`` in its name).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachecd.errors import InvalidRequest, NotStreamable

# mlx_lm.utils.sharded_load's rule for a checkpoint tensor's layer (sanitize can rename tensors).
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
RANK_FIELD = "{rank}"


@dataclass(frozen=True)
class RankGroup:
    """Stands in for an ``mx.distributed.Group`` where only its rank and size are read."""

    rank_: int
    size_: int

    def rank(self) -> int:
        return self.rank_

    def size(self) -> int:
        return self.size_


@dataclass(frozen=True)
class RankLayers:
    """The layers ``[start, end)`` that rank ``rank`` of ``size`` runs, of ``layers`` in all."""

    rank: int
    size: int
    start: int
    end: int
    layers: int

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.end

    def describe(self) -> str:
        return (f"pipeline rank {self.rank} of {self.size}: layers {self.start}-{self.end - 1} "
                f"of {self.layers}")


def skeleton(config: dict[str, Any]) -> Any:
    """mlx-lm's model for ``config`` (the class ``load_model`` picks), lazy: nothing allocated."""
    from mlx_lm.utils import _get_classes

    config = dict(config)
    text = config.get("text_config") or {}
    if "quantization_config" not in config and "quantization_config" in text:
        config["quantization_config"] = text["quantization_config"]  # as load_model does
    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def rank_layers(config: dict[str, Any], rank: int, size: int) -> RankLayers:
    """The layers mlx-lm's ``pipeline`` gives rank ``rank`` of ``size`` for this model."""
    model = skeleton(config)
    inner: Any = getattr(model, "model", None)
    if not hasattr(inner, "pipeline"):
        raise NotStreamable(f"mlx-lm's {config.get('model_type')} model has no pipeline(group): "
                            f"it cannot be split over machines")
    layers = len(inner.layers)
    inner.pipeline(RankGroup(rank, size))
    got = RankLayers(rank, size, int(inner.start_idx), int(inner.end_idx), layers)
    if got.start >= got.end:
        raise InvalidRequest(f"{size} ranks for a model of {layers} layers: rank {rank} gets "
                             f"none; use at most {layers} ranks")
    return got


def model_layers(model: Any) -> tuple[int, int] | None:
    """``[start, end)`` of a loaded model that mlx-lm has split, or None if it runs every layer."""
    inner: Any = getattr(model, "model", None)
    if getattr(inner, "pipeline_size", 1) <= 1:
        return None
    return int(inner.start_idx), int(inner.end_idx)


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def rank_tensors(names: Iterable[str], layers: RankLayers) -> set[str]:
    """The tensors a rank installs: its layers' and every tensor outside the layers."""
    return {n for n in names if (layer := layer_of(n)) is None or layer in layers}


def weights_of_rank(weights: dict[str, Any], start: int, end: int) -> dict[str, Any]:
    """Weights (after sanitize) that a rank running ``[start, end)`` loads."""
    return {k: v for k, v in weights.items()
            if (layer := layer_of(k)) is None or start <= layer < end}


def launched_group() -> Any:
    """The group ``mlx.launch`` started this process in, or None when it runs alone."""
    import mlx.core as mx

    group = mx.distributed.init()
    return group if group.size() > 1 else None


def rank_path(path: str | Path | None, rank: int) -> str | None:
    """``path`` with ``{rank}`` replaced: one command line serves every rank on one machine."""
    if path is None:
        return None
    return str(path).replace(RANK_FIELD, str(rank))


def barrier(group: Any) -> None:
    """Wait until every rank got here (mlx-lm's sharded_load does this after its load)."""
    import mlx.core as mx

    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def gather_ints(group: Any, rows: Any) -> Any:
    """Every rank's int64 ``rows`` (the same shape on each rank), stacked by rank: one
    collective, for figures gathered once generation is over."""
    import mlx.core as mx
    import numpy as np

    mine = mx.array(np.asarray(rows, dtype=np.int64))[None]
    return np.array(mx.distributed.all_gather(mine, group=group, stream=mx.cpu))


def shared_seed(group: Any) -> int:
    """A PRNG seed rank 0 draws and every rank gets: the ranks sample the same token."""
    import mlx.core as mx

    mine = int.from_bytes(os.urandom(4), "little") >> 1 if group.rank() == 0 else 0
    total: Any = mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=group,
                                        stream=mx.cpu).item()
    return int(total)
