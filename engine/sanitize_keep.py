"""Which of a checkpoint's resident tensors mlx-lm's model keeps: asked of mlx-lm itself.

A multimodal repository (K3: ``language_model.`` text weights beside a vision tower and a
projector; DeepSeek-V3: a next-token-prediction layer) holds tensors the text model never loads:
its ``sanitize`` drops them. ``setup --stream`` installs only what is kept.

Invariants:
- Decided from names, dtypes and shapes only, no byte: mlx-lm's own model class (as ``load_model``
  picks it) runs its own ``sanitize`` over lazy placeholders (a broadcast scalar each: nothing
  is allocated even if sanitize evaluates one), with routed experts dropped first as the engine's
  loader drops them.
- A tensor is kept if sanitize passes it on, or if anything it returns is computed from it (the
  MLX graph of the outputs, read through ``mx.export_to_dot``).
- Checked before it is trusted: sanitize over the kept tensors alone must return the same names,
  shapes and dtypes as over all of them; otherwise (or if sanitize cannot run on placeholders)
  every tensor is kept: installing too much costs disk, too little would fail the load.
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx

from cachecd.manifest.dtypes import DTYPES
from cachecd_engine.loader import is_expert_weight
from cachecd_engine.pipeline import skeleton

log = logging.getLogger(__name__)

_EDGE = re.compile(r'^"(in\d+)" -> ', re.M)


class Tensor(Protocol):
    name: str
    dtype: str
    shape: tuple[int, ...]


def kept_names(config: dict[str, Any], tensors: Iterable[Tensor]) -> set[str]:
    """The names among ``tensors`` that mlx-lm's model for ``config`` keeps after sanitize."""
    tensors = list(tensors)
    everything = {t.name for t in tensors}
    if any(_mx_dtype(t.dtype) is None for t in tensors):
        return everything
    try:
        model = skeleton(config)
        if not hasattr(model, "sanitize"):
            return everything
        holders = {t.name: _placeholder(t) for t in tensors if not is_expert_weight(t.name)}
        out = model.sanitize(dict(holders))
        kept = _used(holders, out)
        if _signature(model.sanitize({n: holders[n] for n in kept})) != _signature(out):
            log.warning("sanitize_keep unsure: keeping every tensor")
            return everything
    except Exception as exc:  # noqa: BLE001 - any failure means: keep everything
        log.warning("sanitize_keep failed, keeping every tensor: %s", exc)
        return everything
    return kept


def _mx_dtype(name: str) -> mx.Dtype | None:
    """What mx.load returns for a safetensors dtype (fp8 comes back as its bytes)."""
    d = DTYPES.get(name)
    return getattr(mx, d.mlx) if d is not None and d.mlx is not None else None


def _placeholder(t: Tensor) -> mx.array:
    return mx.broadcast_to(mx.zeros((), _mx_dtype(t.dtype)), tuple(t.shape))


def _used(holders: dict[str, mx.array], out: dict[str, mx.array]) -> set[str]:
    """Inputs passed on as they are, and inputs any other output is computed from."""
    passed = {id(v) for v in out.values()}
    kept = {n for n, a in holders.items() if id(a) in passed}
    inputs = {id(a) for a in holders.values()}
    derived = [v for v in out.values() if id(v) not in inputs]
    rest = [n for n in holders if n not in kept]
    if not derived or not rest:
        return kept
    named = {f"in{i}": n for i, n in enumerate(rest)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sanitize.dot"
        mx.export_to_dot(str(path), *derived, **{k: holders[n] for k, n in named.items()})
        graph = path.read_text()
    return kept | {named[k] for k in _EDGE.findall(graph)}


def _signature(weights: dict[str, mx.array]) -> dict[str, tuple[tuple[int, ...], Any]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in weights.items()}
