"""``setup --stream ORG/NAME --pipeline R/N``: one pipeline rank of a model split over machines.

A rank installs the resident tensors of its own layers plus those every rank keeps (embeddings,
final norm, head), into its own directory (two ranks on one machine never share a resident file),
and registers the model with its daemon restricted to its layers' experts. The layers are those
mlx-lm's ``pipeline(group)`` gives the rank (``cachecd_engine.pipeline``), so setup and the engine
agree by construction.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from cachecd.errors import InvalidRequest
from cachecd.sizes import format_size


def parse_rank(text: str) -> tuple[int, int]:
    """``R/N`` -> (R, N), for ``setup --pipeline``."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m is None:
        raise InvalidRequest(f"--pipeline {text!r}: expected RANK/SIZE, e.g. 0/2")
    rank, size = int(m.group(1)), int(m.group(2))
    if size < 2 or rank >= size:
        raise InvalidRequest(f"--pipeline {text}: SIZE must be >= 2 and RANK in 0..SIZE-1 "
                             f"(without --pipeline setup installs the whole model)")
    return rank, size


def rank_dir(local: Path, rank: int, size: int) -> Path:
    """Where rank ``rank`` of ``size`` installs, beside the whole model's install dir."""
    return local / f"pipeline-{rank}-of-{size}"


def rank_layers(local: Path, rank: int, size: int) -> Any:
    """The rank's ``RankLayers``, from the installed config.json and mlx-lm's pipeline code."""
    from cachecd_engine.pipeline import rank_layers as split

    return split(json.loads((local / "config.json").read_text()), rank, size)


def rank_keep(manifest: Any, keep: set[str], layers: Any) -> set[str]:
    """Of the tensors the text model keeps, the rank's; says how much the other ranks hold."""
    from cachecd_engine.pipeline import rank_tensors

    mine = rank_tensors(keep, layers)
    others = [t for t in manifest.resident if t.name in keep and t.name not in mine]
    print(f"{layers.describe()} (split by mlx-lm's pipeline); every rank keeps the embeddings, "
          f"final norm and head; not installing {len(others)} resident tensors "
          f"({format_size(sum(t.nbytes for t in others))}) of the other ranks' layers")
    return mine


def rank_report(manifest: Any, layers: Any) -> str:
    """The experts this rank's cache may come to hold, against all of the model's."""
    import numpy as np

    lids = manifest.layer_ids
    mine = (lids >= layers.start) & (lids < layers.end)
    moe = np.unique(lids[mine]).size
    nbytes = int(manifest.sizes[mine].sum())
    share = nbytes / manifest.expert_bytes_total if manifest.expert_bytes_total else 0.0
    return (f"rank {layers.rank} of {layers.size}: its daemon streams only its {moe} MoE "
            f"layers' experts into this machine's cache, as routing needs them: "
            f"{int(mine.sum())} experts, {format_size(nbytes)} at most ({share:.1%} of the "
            f"model's {format_size(manifest.expert_bytes_total)} of experts)")
