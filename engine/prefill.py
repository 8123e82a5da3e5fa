"""Prefill layer by layer: every chunk of a prompt through layer 0, then every chunk through
layer 1, and so on, instead of mlx-lm's chunk by chunk through every layer.

Chunk c at layer L depends only on chunk c at layer L-1 and on layer L's cache after the chunks
before c, so the same calls in layer-major order compute the same arrays: each chunk keeps its
own embedding, hidden state, residual blocks (kimi_k3) and masks, and meets each layer's cache
in the state mlx-lm's loop would give it. What changes is the reads: each layer's experts are
needed by one stretch of calls, so with a pool of one layer's experts each is read once.

Invariants:
- Every call is one mlx-lm makes (its own layer modules, mask functions and head) with the same
  inputs; only the order of the chunks' calls changes, never a chunk's shape or a kernel.
- A chunk's mask is made right before the chunk runs the layer the model makes it from
  (``ssm_idx``/``attn_idx`` for kimi_k3, layer 0 for deepseek_v3), when that layer's cache holds
  exactly the chunks before it: the mask mlx-lm's loop makes at the start of that chunk.
- While a pass is at layer L, the pool gives up the slots of layers before L first (dead until
  decode) and those of layer L last (``SlotTable.prefill_layer``); cleared when the pass ends.
- The last layer's expert output of every step but the last is never computed (nothing reads
  it: the caches come before it, the logits are the last step's), as in mlx-lm's lazy loop;
  the streamed bank returns zeros for it (``ExpertBank.discarding``) and reads nothing.
- Only the model types a driver here knows are driven (``driver_for``); any other, or a
  pipelined model, is None: the caller keeps mlx-lm's own loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models import deepseek_v3, kimi_k3
from mlx_lm.models.base import create_attention_mask, create_ssm_mask


@dataclass
class Chunk:
    """One prefill step's state between layers."""

    h: mx.array  # the hidden state after the layers run so far
    blocks: Any = None  # kimi_k3's ResidualBlocks (attention residuals)
    masks: dict[str, Any] = field(default_factory=dict)

    def arrays(self) -> list[mx.array]:
        out = [self.h]
        if self.blocks is not None and self.blocks.raw is not None:
            out += [self.blocks.raw, self.blocks.inv_rms]
        return out


class KimiK3Layers:
    """kimi_k3's text model (``KimiK3TextModel.__call__``), one layer at a time."""

    def __init__(self, model: kimi_k3.Model) -> None:
        self.lm = model.language_model
        self.tm = self.lm.model

    @property
    def num_layers(self) -> int:
        return int(self.tm.num_layers)

    def start(self, inputs: mx.array) -> Chunk:
        tm = self.tm
        blocks = kimi_k3.ResidualBlocks(tm.args.rms_norm_eps) if tm.use_attn_res else None
        return Chunk(tm.embed_tokens(inputs), blocks)

    def layer(self, i: int, c: Chunk, cache: list[Any]) -> None:
        tm = self.tm
        # The masks come only from the shape and the cache, made where the model makes them.
        if i == tm.ssm_idx:
            c.masks["ssm"] = create_ssm_mask(c.h, cache[i])
        if i == tm.attn_idx:
            c.masks["attn"] = create_attention_mask(c.h, cache[i], return_array=True)
        layer = tm.layers[tm.start_idx + i]
        mask = c.masks.get("ssm") if layer.is_linear else c.masks.get("attn")
        c.h, c.blocks = layer(c.h, mask=mask, cache=cache[i], blocks=c.blocks)

    def head(self, c: Chunk) -> mx.array:
        tm: Any = self.tm  # mlx-lm's annotations say None for the cached weights
        h = c.h
        if c.blocks is not None:  # the output's attention residual, as the text model mixes it
            if tm.training or tm._output_res_w_eff is None:
                tm._output_res_w_eff = tm.output_attn_res_norm.weight.astype(
                    mx.float32) * tm.output_attn_res_proj.weight.reshape(-1)
            h = kimi_k3._attn_res_mix(c.blocks, h, tm._output_res_w_eff, tm.args.rms_norm_eps,
                                      not tm.training)
        out = tm.norm(h)
        if self.lm.lm_head is None:
            return tm.embed_tokens.as_linear(out)
        return self.lm.lm_head(out)


class DeepseekV3Layers:
    """deepseek_v3's model (K2's too: mlx-lm maps kimi_k2 to it), one layer at a time."""

    def __init__(self, model: deepseek_v3.Model) -> None:
        self.model = model
        self.tm = model.model

    @property
    def num_layers(self) -> int:
        return len(self.tm.pipeline_layers)

    def start(self, inputs: mx.array) -> Chunk:
        return Chunk(self.tm.embed_tokens(inputs))

    def layer(self, i: int, c: Chunk, cache: list[Any]) -> None:
        if i == 0:
            c.masks["attn"] = create_attention_mask(c.h, cache[0], return_array=True)
        c.h = self.tm.pipeline_layers[i](c.h, c.masks["attn"], cache=cache[i])

    def head(self, c: Chunk) -> mx.array:
        return self.model.lm_head(self.tm.norm(c.h))


Driver = KimiK3Layers | DeepseekV3Layers


def driver_for(model: Any) -> Driver | None:
    """The layer driver for ``model``, or None (another type, or split over machines)."""
    if isinstance(model, kimi_k3.Model):
        tm = model.language_model.model
        return KimiK3Layers(model) if tm.pipeline_size == 1 else None
    if isinstance(model, deepseek_v3.Model):
        return DeepseekV3Layers(model) if model.model.pipeline_size == 1 else None
    return None


def prefill(driver: Driver, steps: list[mx.array], cache: list[Any], bank: Any = None,
            on_layer: Callable[[int, int], None] | None = None, *, logits: bool = True,
            after: Callable[[int, int], list[mx.array]] | None = None) -> mx.array | None:
    """The logits of the last of ``steps`` (token arrays ``[B, n]``, in prompt order) after
    running them all layer-major through ``cache``, which ends as mlx-lm's loop leaves it.
    Without ``logits`` no step's output is wanted (mlx-lm's ``BatchGenerator`` drops every
    prefill step's): the last layer's experts are read for none, and None is returned.
    ``after(layer, step)``, called after each step's layer call, returns arrays to keep."""
    chunks = [driver.start(x) for x in steps]
    n = driver.num_layers
    try:
        for i in range(n):
            if bank is not None:
                bank.prefill_at(i)
            kept: list[mx.array] = []
            for j, c in enumerate(chunks):
                # The last layer's output of a step before the last feeds nothing (no cache,
                # no logits), as mlx-lm's lazy loop never computes it: its experts are not read.
                unread = bank is not None and i == n - 1 and (j < len(chunks) - 1 or not logits)
                if unread:
                    bank.discarding = True
                try:
                    driver.layer(i, c, cache)
                finally:
                    if unread:
                        bank.discarding = False
                if after is not None:
                    kept += after(i, j)
            # As mlx-lm evaluates each step's cache: the layer's state, and what the next needs.
            last = chunks if i < n - 1 else chunks[-1:] if logits else []
            mx.eval(cache[i].state, [a for c in last for a in c.arrays()], kept)
            if on_layer is not None:
                on_layer(i + 1, n)
    finally:
        if bank is not None:
            bank.prefill_at(None)
    return driver.head(chunks[-1]) if logits else None
