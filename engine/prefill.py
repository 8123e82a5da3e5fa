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
- With a pool smaller than a layer's experts, a layer's chunks go through it together
  (``_layer_together``, ``pool.chunks``): each chunk runs the layer twice, the first run's
  expert output thrown away and its attention's output (and cache writes) kept and replayed in
  the second, whose expert call gets the output computed for exactly that call (its input and
  routing checked bitwise before the pass goes on). Every array the second run makes is the
  one mlx-lm's call makes; the masks kept are the first run's, made as above.
- Only the model types a driver here knows are driven (``driver_for``); any other, or a
  pipelined model, is None: the caller keeps mlx-lm's own loop.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models import deepseek_v3, kimi_k3
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

from cachecd import errors
from cachecd_engine.pool.chunks import ChunkBatch


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

    def module(self, i: int) -> Any:
        return self.tm.layers[self.tm.start_idx + i]

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

    def module(self, i: int) -> Any:
        return self.tm.pipeline_layers[i]

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
            after: After | None = None) -> mx.array | None:
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
            if bank is not None and i < n - 1 and len(chunks) > 1 and bank.groups_chunks():
                _layer_together(driver, i, chunks, cache, bank, after, kept)
            else:
                _layer_in_turn(driver, i, chunks, cache, bank, logits, i == n - 1, after, kept)
            # As mlx-lm evaluates each step's cache: the layer's state, and what the next needs.
            last = chunks if i < n - 1 else chunks[-1:] if logits else []
            mx.eval(cache[i].state, [a for c in last for a in c.arrays()], kept)
            if on_layer is not None:
                on_layer(i + 1, n)
    finally:
        if bank is not None:
            bank.prefill_at(None)
    return driver.head(chunks[-1]) if logits else None


After = Callable[[int, int], list[mx.array]]
WINDOW_NBYTES = 1 << 30  # the expert outputs a window of chunks may hold at least (K3: 4.6k tokens)


def _layer_in_turn(driver: Driver, i: int, chunks: list[Chunk], cache: list[Any], bank: Any,
                   logits: bool, last: bool, after: After | None, kept: list[mx.array]) -> None:
    """Layer ``i`` for each chunk in turn, each call reading what the pool lacks."""
    for j, c in enumerate(chunks):
        # The last layer's output of a step before the last feeds nothing (no cache, no
        # logits), as mlx-lm's lazy loop never computes it: its experts are not read.
        unread = bank is not None and last and (j < len(chunks) - 1 or not logits)
        if unread:
            bank.discarding = True
        try:
            driver.layer(i, c, cache)
        finally:
            if unread:
                bank.discarding = False
        if after is not None:
            kept += after(i, j)


def _layer_together(driver: Driver, i: int, chunks: list[Chunk], cache: list[Any],
                    bank: Any, after: After | None, kept: list[mx.array]) -> None:
    """Layer ``i`` for windows of chunks whose expert calls are computed together
    (``pool.chunks``): each chunk runs the layer once, its attention's output recorded and its
    expert call collected (answered with zeros: that run's layer output is thrown away; the
    cache writes are the attention's and stand); the calls are computed group by group (each
    group of experts read once for the window); then each chunk runs the layer again from where
    it was, its attention answered with the recorded output (no second attention, no second
    cache write) and its expert call with its output. A window's outputs take at most
    ``WINDOW_NBYTES`` or a quarter of the pool's memory, whichever is more (at least one
    chunk)."""
    pool = bank.memory.nbytes if bank.memory is not None else 0
    bound = bank.window_nbytes or max(WINDOW_NBYTES, pool // 4)
    module = driver.module(i)
    attention = module.self_attn
    start = 0
    while start < len(chunks):
        saved = [(c.h, copy.copy(c.blocks)) for c in chunks[start:]]
        batch = bank.chunks = ChunkBatch(bank)
        record = module.self_attn = _Attention(attention)
        end = start
        try:
            while end < len(chunks):
                driver.layer(i, chunks[end], cache)
                if after is not None:  # the step's cache writes are this run's (attention's)
                    kept += after(i, end)
                end += 1
                if batch.output_nbytes() >= bound:
                    break
            if batch.calls:  # else no MoE call (a dense layer): those outputs were real
                masks = [c.masks for c in chunks[start:end]]
                for c, (h, blocks) in zip(chunks[start:end], saved, strict=False):
                    c.h, c.blocks, c.masks = h, blocks, dict(c.masks)
                batch.compute()
                record.replaying = True
                for c, m in zip(chunks[start:end], masks, strict=True):
                    driver.layer(i, c, cache)
                    c.masks = m  # as the first run made them (the replay's were not used)
                batch.verify()
                if record.left():
                    raise errors.Internal(f"a grouped prefill pass of layer {i} replayed "
                                          f"{record.left()} attention calls too few")
        finally:
            bank.chunks = None
            module.self_attn = attention
        start = end


class _Attention(nn.Module):
    """A layer's attention, recorded on the first run of a window's chunks and replayed in the
    same order on the second (an ``nn.Module``, so it takes the attention's place in the layer's
    tree for the pass and gives it back after)."""

    def __init__(self, attention: Any) -> None:
        super().__init__()
        object.__setattr__(self, "_inner", attention)
        object.__setattr__(self, "_outputs", [])
        object.__setattr__(self, "_next", 0)
        object.__setattr__(self, "replaying", False)

    def __setattr__(self, key: str, val: Any) -> None:
        object.__setattr__(self, key, val)

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        if not self.replaying:
            out = self._inner(*args, **kwargs)
            self._outputs.append(out)
            return out
        if self._next >= len(self._outputs):
            raise errors.Internal("a grouped prefill pass replayed more attention calls than it ran")
        self._next += 1
        return self._outputs[self._next - 1]

    def left(self) -> int:
        return len(self._outputs) - self._next
