"""Why a prefill runs step by step, said once: in the log and as a Python warning.

A prompt prefilled step by step reads every layer's experts again each step (a 32k-token K3
prompt: 16 passes over 1.446 TB), so each path that takes it says so, with the reason and what
to do, once per model and reason (``Said``): a rotating or quantized KV cache, input
embeddings, the model called through a wrapper inside mlx-lm's loop, a copy of that loop, the
caller's own loop of chunks (``cachecd_engine.prefill_chunks`` runs those layer by layer).

Invariants:
- Saying never changes what runs: every call here only reads frames and caches.
- A reason is said once per model (``Said.keys``); Python's warning filters may show it fewer
  times, never more.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from types import CodeType, FrameType
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from cachecd_engine.pool.speculate import plain_caches

log = logging.getLogger(__name__)

HELPER = "cachecd_engine.prefill_chunks(model, chunks, cache)"
WRAPPER_DEPTH = 4  # frames between the model's call and mlx-lm's loop still taken as a wrapper
_LOOP_NAMES = {"generate_step", "speculative_generate_step", "_model_call", "_prefill"}


class PrefillStepByStep(UserWarning):
    """A prefill runs step by step (every layer's experts read again each step), not layer by
    layer: the message says why and what to do."""


class Said:
    """Each reason said once (``log.warning`` and ``warnings.warn``)."""

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def __call__(self, key: str, message: str, stacklevel: int = 5) -> None:
        """``stacklevel``: the warning points at the model's caller (through the model's
        ``__call__`` and the deferral by default)."""
        if key in self.keys:
            return
        self.keys.add(key)
        text = f"prefill runs step by step, reading every layer's experts again each step: {message}"
        log.warning("%s (event=prefill_step_by_step reason=%s)", text, key)
        warnings.warn(text, PrefillStepByStep, stacklevel=stacklevel)


def _where(frame: FrameType) -> str:
    return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"


def cache_reason(cache: Any, batched: bool = False) -> tuple[str, str] | None:
    """Why these caches (``BatchGenerator``'s where ``batched``) are not run layer by layer
    (key, message); None if they can be."""
    if not isinstance(cache, list) or not cache:
        return None
    allowed = (BatchKVCache, ArraysCache) if batched else (KVCache, ArraysCache)
    kinds = sorted({type(c).__name__ for c in cache if type(c) not in allowed})
    if any("Rotating" in k for k in kinds):
        return "rotating_cache", (
            "a rotating KV cache (max_kv_size) keeps a window of each layer's tokens, which a "
            "layer-by-layer pass does not replay; leave max_kv_size unset to prefill layer by "
            "layer")
    if any("Quantized" in k for k in kinds):
        return "quantized_cache", ("a quantized KV cache (kv_bits) is read between steps; "
                                   "leave kv_bits unset to prefill layer by layer")
    if kinds:
        return "cache_type", (f"caches of type {', '.join(kinds)}: only KVCache and "
                              f"ArraysCache are run layer by layer; use make_prompt_cache(model)")
    if not batched and any(type(c) is ArraysCache and (c.lengths is not None or c.left_padding is not None)
           for c in cache):
        return "padded_cache", "padded linear-attention caches: use make_prompt_cache(model)"
    return None


def loop_reason(frame: FrameType | None, steps: dict[CodeType, CodeType], known: set[CodeType],
                kv_bits: Callable[[FrameType], bool]) -> tuple[str, str] | None:
    """Why a prefill step of one of mlx-lm's loops (``steps``: step function's code -> its
    loop's; ``known``: every code object of the reviewed loops) runs step by step, when
    ``frame`` (the model call's caller) is in such a loop's prefill but the call is not held
    back; None when it is not such a step."""
    f, depth = frame, 0
    while f is not None and depth <= WRAPPER_DEPTH:
        loop = steps.get(f.f_code)
        if loop is not None and f.f_back is not None and f.f_back.f_code is loop:
            if depth > 0:
                assert frame is not None
                return "wrapped", (
                    f"the model is called through {_where(frame)} inside mlx-lm's prefill loop, "
                    f"so the engine cannot see that the loop drops the output; give mlx-lm the "
                    f"model cachecd_engine.load returned, unwrapped, or prefill with {HELPER}")
            if kv_bits(f.f_back):
                return "quantized_cache", ("a quantized KV cache (kv_bits) is read between "
                                           "steps; leave kv_bits unset to prefill layer by layer")
            if f.f_locals.get("input_embeddings") is not None:
                return "input_embeddings", ("input embeddings (images) are prefilled as mlx-lm "
                                            "does; a text-only prompt runs layer by layer")
            return None
        if f.f_code.co_name in _LOOP_NAMES and f.f_code not in known:
            return "copied_loop", (
                f"the model is called from {_where(f)}, a copy of mlx-lm's loop or another "
                f"mlx-lm's (the engine holds back steps only for the loop it reviewed); call "
                f"mlx_lm.generate_step / stream_generate, or prefill with {HELPER}")
        f, depth = f.f_back, depth + 1
    return None


class ChunkedLoops:
    """The caller's own loop of chunks: two calls of several tokens each in a row on one cache
    from one line of code (its decode steps are one token; mlx-lm's loops are told apart before
    this is asked)."""

    def __init__(self) -> None:
        self.last: tuple[int, CodeType, int] | None = None  # (cache entry id, code, line)

    def seen(self, frame: FrameType | None, inputs: Any, cache: Any) -> str | None:
        """The caller's place when this call continues its chunked loop, else None."""
        if frame is None or not isinstance(cache, list) or not cache \
                or getattr(inputs, "ndim", 0) != 2 or inputs.shape[1] < 2:
            self.last = None
            return None
        here = (id(cache[0]), frame.f_code, frame.f_lineno)
        again, self.last = self.last == here, here
        return _where(frame) if again else None


def prefill_chunks(model: Any, chunks: Sequence[mx.array], cache: list[Any]) -> mx.array:
    """What ``for c in chunks: out = model(c, cache=cache)`` returns (the last chunk's logits)
    and the caches it leaves, bitwise, for a caller's own loop of chunks (token arrays
    ``[B, n]`` in prompt order): layer by layer on a model from ``cachecd_engine.load`` (each
    layer's experts read once for all the chunks), else that loop, saying why once."""
    chunks = list(chunks)
    if not chunks:
        raise ValueError("prefill_chunks needs at least one chunk")
    deferral: Any = getattr(model, "__dict__", {}).get("deferral")  # prefill_defer.Deferral
    why = None
    if deferral is not None:
        why = cache_reason(cache) or (None if plain_caches(cache) else (
            "cache_type", "caches mlx-lm's make_prompt_cache(model) did not make"))
        if deferral.driver is None:
            why = ("model_type", f"{type(model).__name__} has no layer driver "
                                 f"(another model type, or split over machines)")
        elif any(not isinstance(c, mx.array) or c.ndim != 2 for c in chunks):
            why = ("chunk_shape", "chunks must be token arrays [B, n]")
    if deferral is not None and why is None:
        return deferral.run_chunks(chunks, cache)
    if deferral is not None and why is not None:
        deferral.said(*why, stacklevel=3)
    out = None
    for c in chunks:
        out = model(c, cache=cache)
    assert out is not None
    return out


PREFILL_CHUNKS = prefill_chunks.__code__  # its own loop of chunks is not the caller's
