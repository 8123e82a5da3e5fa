"""The streamed expert bank: mlx-lm's SwitchGLU computation over a shrunk stack of routed experts.

Invariants (the bit-identity argument):
- Every routed expert is used; none is skipped, pruned or approximated.
- The stack holds exactly the routed experts of this call, in ascending id order, with the same
  dtype and layout as the resident stack; indices are remapped monotonically into it, so every
  row meets the same weights, the sort decision (made on the indices' size) is the same, and the
  ordering of rows after mlx-lm's argsort is the same as in the resident model.
- The computation is mlx-lm's own SwitchGLU (and its QuantizedSwitchLinear/SwitchLinear): one
  gather per projection over all routed rows, the same activation.
- Routing is read back once per layer. The output stays lazy: the next MoE layer's read-back
  evaluates it (its routing depends on it), so at most two layers' stacks are alive, plus the
  RAM tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

from cachecd_engine.formats import (
    Arrays,
    Buffer,
    DecodedExpert,
    QuantSpec,
    decode_expert,
    stack_experts,
)
from cachecd_engine.ram_tier import RamTier

log = logging.getLogger(__name__)


class ExpertSource(Protocol):
    """Where expert bytes come from (the daemon client in production)."""

    def experts(self, layer: int, ids: list[int]) -> Sequence[Buffer]:
        """Each expert's bytes, in the order asked."""
        ...

    def entry(self, layer: int, expert: int) -> Any:
        """The expert's manifest entry (``cachecd.manifest.ExpertEntry``): its layout."""
        ...

    def prefetch(self, layer: int, ids: list[int]) -> None:
        """A fire-and-forget hint that these experts are wanted soon."""
        ...


@dataclass
class EngineStats:
    """Counters since the last ``reset``; the caller reads and resets them per step."""

    layer_calls: int = 0
    rows: int = 0  # routed (token, slot) pairs
    experts_routed: int = 0  # distinct experts per layer call, summed
    ram_hits: int = 0
    source_hits: int = 0  # experts the source delivered (RAM misses)
    source_bytes: int = 0
    source_wait_s: float = 0.0
    decode_s: float = 0.0

    def reset(self) -> None:
        for name, value in asdict(EngineStats()).items():
            setattr(self, name, value)

    def snapshot(self) -> dict[str, float]:
        return asdict(self)


class ExpertBank:
    """Gets a layer's routed experts (RAM tier first, then one source call for the misses)."""

    def __init__(
        self, source: ExpertSource, spec: QuantSpec, ram: RamTier, stats: EngineStats | None = None
    ) -> None:
        self.source = source
        self.spec = spec
        self.ram = ram
        self.stats = stats or EngineStats()
        # Optional observer called with (layer, routed ids) once per layer call (engine.trace).
        self.trace: Callable[[int, np.ndarray], None] | None = None

    def experts(self, layer: int, ids: list[int]) -> list[DecodedExpert]:
        found, missing = self.ram.get_many(layer, ids)
        self.stats.experts_routed += len(ids)
        self.stats.ram_hits += len(found)
        if missing:
            found.update(self._fetch(layer, missing))
        return [found[e] for e in ids]

    def _fetch(self, layer: int, missing: list[int]) -> dict[int, DecodedExpert]:
        t0 = time.perf_counter()
        bufs = self.source.experts(layer, missing)
        t1 = time.perf_counter()
        out: dict[int, DecodedExpert] = {}
        for e, buf in zip(missing, bufs, strict=True):
            entry = self.source.entry(layer, e)
            decoded = decode_expert(self.spec, entry, buf)  # checks len(buf) == entry.nbytes
            self.ram.put(layer, e, decoded)
            self.stats.source_bytes += entry.nbytes
            out[e] = decoded
        self.stats.source_hits += len(missing)
        self.stats.source_wait_s += t1 - t0
        self.stats.decode_s += time.perf_counter() - t1
        return out

    def stacks(self, layer: int, ids: list[int]) -> Arrays:
        return stack_experts(self.experts(layer, ids))


def as_template(glu: SwitchGLU, spec: QuantSpec) -> SwitchGLU:
    """Make ``glu`` compute like the resident bank of this format: quantize it as mlx-lm would."""
    if spec.mode is not None and isinstance(glu.gate_proj, SwitchLinear):
        # Lazy: the placeholder weights are never evaluated, each call replaces them.
        nn.quantize(glu, spec.group_size, spec.bits, mode=spec.mode)
    return glu


class StreamedSwitchGLU(nn.Module):
    """Called as mlx-lm calls ``switch_mlp``: ``(x, indices) -> y``. Holds no parameters."""

    def __init__(self, layer: int, template: SwitchGLU, bank: ExpertBank) -> None:
        super().__init__()
        self.layer = layer
        # Kept out of the module tree: no parameter to load, nothing for nn.quantize to touch.
        object.__setattr__(self, "_glu", template)
        object.__setattr__(self, "_bank", bank)
        self.prefetcher: Any = None  # set by cachecd_engine.prefetch.install_prefetch

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        guess = self.prefetcher.take(self.layer) if self.prefetcher is not None else None
        if guess is not None:
            mx.eval(indices, guess)  # one sync for the routing and the next layer's guess
            self.prefetcher.send(self.layer, np.array(guess))
        routed = np.array(indices)  # the one read-back of this layer's routing
        ids, local = remap(routed)
        bank: ExpertBank = self._bank
        if bank.trace is not None:
            bank.trace(self.layer, routed)
        bank.stats.layer_calls += 1
        bank.stats.rows += routed.size
        stacks = bank.stacks(self.layer, ids)
        glu: SwitchGLU = self._glu
        for proj, arrays in stacks.items():
            for name, arr in arrays.items():
                setattr(getattr(glu, proj), name, arr)
        y = glu(x, mx.array(local))
        for proj in stacks:
            _release(getattr(glu, proj))
        return y

    def _extra_repr(self) -> str:
        return f"layer={self.layer}, streamed"


_SMALL = 64  # below this many rows (decode) plain Python beats numpy's per-call overhead


def remap(routed: np.ndarray) -> tuple[list[int], np.ndarray]:
    """(distinct experts ascending, indices replaced by their position in that list)."""
    if routed.size < _SMALL:
        flat = routed.ravel().tolist()
        ids = sorted(set(flat))
        pos = {e: i for i, e in enumerate(ids)}
        local = np.array([pos[e] for e in flat], dtype=routed.dtype).reshape(routed.shape)
        return ids, local
    uniq = np.unique(routed)
    return uniq.tolist(), np.searchsorted(uniq, routed).astype(routed.dtype)


_EMPTY = mx.zeros((0,), dtype=mx.uint8)


def _release(proj: nn.Module) -> None:
    # Drop the call's stacks now rather than when the next call overwrites them.
    for name in ("weight", "scales", "biases"):
        if name in proj and proj[name] is not None:
            proj[name] = _EMPTY


def install_streamed_banks(model: nn.Module, bank: ExpertBank) -> list[int]:
    """Replace each MoE layer's ``mlp.switch_mlp`` with a streamed bank; return the layer ids."""
    layers = []
    for idx, layer in enumerate(model.layers):
        mlp = getattr(layer, "mlp", None)
        glu = getattr(mlp, "switch_mlp", None)
        if isinstance(glu, StreamedSwitchGLU):
            layers.append(idx)
        elif mlp is not None and isinstance(glu, SwitchGLU):
            mlp.switch_mlp = StreamedSwitchGLU(idx, as_template(glu, bank.spec), bank)
            layers.append(idx)
    log.debug("streamed banks installed layers=%d", len(layers))
    return layers
