"""mlx-lm's own prefill loop, run layer by layer: its steps are held back, then run layer-major.

``mlx_lm.generate_step`` (what ``generate``, ``stream_generate`` and the server's single-request
path run) prefills with ``model(chunk, cache)`` per step, drops the output, evaluates the
caches, and then calls ``model(last, cache)`` for the logits (its ``_step``). The streamed model
cannot change that loop, so it holds back the calls whose output the loop drops and, when the
next call needs real output, runs all of them and that call layer-major (``prefill``).

Invariants:
- A call is held back only when its caller is, provably, that loop: the calling frame is the
  loop's ``_model_call`` called from ``generate_step`` itself (its ``_step`` is the other
  caller), ``generate_step``'s source is the one reviewed here (``REVIEWED_SHA256``; another
  mlx-lm turns holding back off, and a test fails), no KV quantization (the loop would read the
  caches' offsets), no input embeddings, batch 1, no other argument, and every cache a plain
  ``KVCache`` or ``ArraysCache``. A held-back call returns None: no number at all to misuse.
- Between held-back calls the loop only evaluates the caches' state (unchanged, so a no-op) and
  reports progress; any call that is not held back first runs what is held (with it, if it is
  the same cache's next step; before it otherwise), so nothing reads a cache that is behind.
- The loop's progress callback still hears from it during a pass: once a layer, with the
  figures it last reported (the server's keepalive comments keep coming). ``on_layer``, where
  set, hears first: ``(0, layers)`` as a pass starts, then ``(layers done, layers)`` after each
  layer (``cachecd run``, ``warm --prompts`` and the server's log show layers done); while the
  pass runs ``running`` is True.
- If the layer-major run fails, what was held is dropped (the caches are as partial as a
  failed step leaves them in mlx-lm's loop) and the error goes to the caller.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step

from cachecd_engine.pool.speculate import plain_caches
from cachecd_engine.prefill import Driver, driver_for, prefill

log = logging.getLogger(__name__)

# sha256 of ``inspect.getsource(mlx_lm.generate.generate_step)`` as reviewed (mlx-lm 0.32.2):
# the prefill loop drops ``_model_call``'s output and reads the caches only through
# ``mx.eval([c.state ...])`` and ``quantize_cache_fn`` (a no-op without kv_bits).
REVIEWED_SHA256 = "f5dd8df9242ffb752fc65160d08fde54ae5148813dd4332b4a7f35852f36bdb0"


def _source_sha256(fn: Callable[..., Any]) -> str | None:
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    except (OSError, TypeError):
        return None


def _nested_code(code: CodeType, name: str) -> CodeType | None:
    return next((c for c in code.co_consts if isinstance(c, CodeType) and c.co_name == name),
                None)


_GENERATE_STEP = generate_step.__code__
_MODEL_CALL = _nested_code(_GENERATE_STEP, "_model_call")


def loop_reviewed() -> bool:
    """mlx-lm's ``generate_step`` is the loop reviewed here (holding back is safe with it)."""
    return _MODEL_CALL is not None and _source_sha256(generate_step) == REVIEWED_SHA256


def dropped_by_caller(frame: FrameType | None, inputs: Any, cache: Any, extra: bool) -> bool:
    """True when ``frame`` (the model call's caller) is generate_step's prefill loop, which
    drops the output, under the conditions the module docstring lists."""
    if frame is None or frame.f_code is not _MODEL_CALL or extra:
        return False
    outer = frame.f_back
    if outer is None or outer.f_code is not _GENERATE_STEP:
        return False  # _step, the call whose logits are used
    if frame.f_locals.get("input_embeddings") is not None:
        return False
    if outer.f_locals.get("kv_bits") is not None:
        return False
    return isinstance(inputs, mx.array) and inputs.ndim == 2 and inputs.shape[0] == 1 \
        and isinstance(cache, list) and plain_caches(cache)


class Deferral:
    """Held-back prefill steps of one cache, run layer-major when output is needed."""

    def __init__(self, model: Any, bank: Any, on: bool = True) -> None:
        self.driver: Driver | None = driver_for(model)
        self.bank = bank
        self.on = on and self.driver is not None and loop_reviewed()
        if on and self.driver is not None and not self.on:
            log.warning("prefill runs step by step: mlx_lm.generate_step is not the loop "
                        "reviewed for layer-by-layer prefill (mlx-lm %s)", _mlx_lm_version())
        self.held: list[mx.array] = []
        self.cache: list[Any] | None = None
        # Called with (0, layers) as a pass starts and (layers done, layers) after each layer,
        # before the loop's own progress callback is called again with what it last reported.
        self.on_layer: Callable[[int, int], None] | None = None
        self.running = False  # a pass is running (the loop's callback hears it again per layer)
        self._progress: tuple[Callable[[int, int], None], int, int] | None = None
        self.passes = 0  # layer-major runs
        self.held_steps = 0  # steps held back, in all

    def call(self, forward: Callable[[], mx.array], inputs: mx.array, cache: Any,
             frame: FrameType | None, extra: bool) -> mx.array | None:
        """The model's call: held back (None), or run (with what is held)."""
        if self.on and dropped_by_caller(frame, inputs, cache, extra):
            if self.held and cache is not self.cache:
                self.run()
            self.cache = cache
            self.held.append(inputs)
            self.held_steps += 1
            self._loop_progress(frame)
            return None
        if not self.held:
            return forward()
        same = cache is self.cache and not extra and isinstance(inputs, mx.array) \
            and inputs.ndim == 2 and inputs.shape[0] == 1
        if not (same and frame is not None and frame.f_code is _MODEL_CALL):
            self._progress = None  # not the loop's own last step: its callback is not called
        if same:
            return self.run(inputs)
        self.run()
        return forward()

    def _loop_progress(self, frame: FrameType | None) -> None:
        """What the loop will report once this step returns (its progress callback, tokens
        done, tokens in all): repeated after each layer of the pass, so whatever the loop's
        callback does per step (the server's keepalive comments) goes on during it."""
        outer = frame.f_back if frame is not None else None
        f = outer.f_locals if outer is not None else {}
        try:
            self._progress = (f["prompt_progress_callback"],
                              int(f["prompt_processed_tokens"]) + int(f["n_to_process"]),
                              int(f["total_prompt_tokens"]))
        except (KeyError, TypeError, ValueError):
            self._progress = None

    def _per_layer(self) -> Callable[[int, int], None] | None:
        on_layer, loop = self.on_layer, self._progress
        if loop is None:
            return on_layer

        def both(layer: int, layers: int) -> None:
            if on_layer is not None:
                on_layer(layer, layers)
            callback, done, total = loop
            callback(done, total)

        return both

    def run(self, last: mx.array | None = None) -> mx.array:
        """Run what is held (and ``last``) layer-major; the logits of the last step."""
        steps, cache = self.held + ([last] if last is not None else []), self.cache
        on_layer, self.held, self.cache, self._progress = self._per_layer(), [], None, None
        assert self.driver is not None and cache is not None
        self.passes += 1
        self.running = True
        try:
            if self.on_layer is not None:
                self.on_layer(0, self.driver.num_layers)
            logits = prefill(self.driver, steps, cache, self.bank, on_layer)
            assert logits is not None
            return logits
        finally:
            self.running = False


def _mlx_lm_version() -> str:
    import mlx_lm

    return str(getattr(mlx_lm, "__version__", "?"))
