"""mlx-lm's own prefill loop, run layer by layer: its steps are held back, then run layer-major.

``mlx_lm.generate_step`` (what ``generate``, ``stream_generate`` and the server's single-request
path run) prefills with ``model(chunk, cache)`` per step, drops the output, evaluates the
caches, and then calls ``model(last, cache)`` for the logits (its ``_step``). The streamed model
cannot change that loop, so it holds back the calls whose output the loop drops and, when the
next call needs real output, runs all of them and that call layer-major (``prefill``).

``speculative_generate_step`` (a draft model) prefills the same way in its ``_prefill``, then
verifies the drafts in one call (its ``_step``): its steps are held back and run with that call.

Invariants:
- A call is held back only when its caller is, provably, such a loop: the calling frame is the
  loop's ``_model_call`` (``_prefill``) called from the loop itself (its ``_step`` is the other
  caller), the loop's source is the one reviewed here (``REVIEWED_SHA256``,
  ``REVIEWED_SPECULATIVE_SHA256``; another mlx-lm turns holding back off, and a test fails), no
  KV quantization (the loop would read the caches' offsets), no input embeddings, batch 1, no
  other argument, and every cache a plain ``KVCache`` or ``ArraysCache``. A held-back call
  returns None: no number at all to misuse. Every other prefill of several steps is said once
  (``prefill_fallback``).
- Held steps belong to their loop's run and their cache (``_Held``), both held weakly: a call on
  another cache never runs them; a call on their cache that is not their loop's next step runs
  them first, so nothing reads a cache that is behind; once their loop is off the stack (it
  never yields while it prefills, so it ended: an exception, Ctrl-C) they are dropped at the next
  call, never run.
- A cache left part way is refused (``PromptCacheUnusable``, naming what to do) at its next
  call: one whose held steps were dropped (mlx-lm's loop would have run them), one whose pass
  failed (its layers hold the prompt up to different steps).
- The loop's progress callback hears steady progress (``prefill_progress.LoopProgress`` in its
  place in the loop's frame): nothing for a held step, which has done no work; after each layer
  of the pass the tokens that share of the pass stands for (the server's keepalive comments
  keep coming); then the loop's own reports. ``on_layer``, where set, hears first: ``(0,
  layers)`` as a pass starts, then ``(layers done, layers)`` after each layer (``cachecd run``,
  ``warm --prompts`` and the server's log show layers done); while the pass runs ``running`` is
  True.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step

from cachecd import errors
from cachecd_engine.pool.speculate import plain_caches
from cachecd_engine.prefill import Driver, driver_for, prefill
from cachecd_engine.prefill_batch import batch_step
from cachecd_engine.prefill_fallback import (
    HELPER,
    PREFILL_CHUNKS,
    ChunkedLoops,
    Said,
    cache_reason,
    loop_reason,
)
from cachecd_engine.prefill_progress import LoopProgress, set_local

log = logging.getLogger(__name__)

# sha256 of ``inspect.getsource(mlx_lm.generate.generate_step)`` as reviewed (mlx-lm 0.32.2):
# the prefill loop drops ``_model_call``'s output and reads the caches only through
# ``mx.eval([c.state ...])`` and ``quantize_cache_fn`` (a no-op without kv_bits).
REVIEWED_SHA256 = "f5dd8df9242ffb752fc65160d08fde54ae5148813dd4332b4a7f35852f36bdb0"
# The same of ``speculative_generate_step`` (a draft model): its ``_prefill`` drops the model's
# output and reads the caches as above; its first verify step (``_step``) is one call.
REVIEWED_SPECULATIVE_SHA256 = "84bed200ad064afddeaeb972f79469cce568f74ccc8813d8f5cda7c97ea1d0fd"


def _source_sha256(fn: Callable[..., Any]) -> str | None:
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    except (OSError, TypeError):
        return None


def _nested_code(code: CodeType, name: str) -> CodeType | None:
    return next((c for c in code.co_consts if isinstance(c, CodeType) and c.co_name == name),
                None)


def _codes(code: CodeType) -> set[CodeType]:
    return {code} | {n for c in code.co_consts if isinstance(c, CodeType) for n in _codes(c)}


_GENERATE_STEP = generate_step.__code__
_MODEL_CALL = _nested_code(_GENERATE_STEP, "_model_call")
_SPECULATIVE = speculative_generate_step.__code__
_SPEC_PREFILL = _nested_code(_SPECULATIVE, "_prefill")
# Each loop's function that calls the model for a prefill step, and the closure that is new
# each run of the loop (what tells one run's frame from another's at the same address).
_RUN_LOCAL = {_GENERATE_STEP: "_model_call", _SPECULATIVE: "_prefill"}
# Every code object of the loops: the caller's own loop of chunks is none of these.
_KNOWN = _codes(_GENERATE_STEP) | _codes(_SPECULATIVE)


def loop_reviewed() -> bool:
    """mlx-lm's ``generate_step`` is the loop reviewed here (holding back is safe with it)."""
    return _MODEL_CALL is not None and _source_sha256(generate_step) == REVIEWED_SHA256


def _steps() -> dict[CodeType, CodeType]:
    """The reviewed loops' prefill-step functions (code -> their loop's code)."""
    out = {}
    if loop_reviewed() and _MODEL_CALL is not None:
        out[_MODEL_CALL] = _GENERATE_STEP
    if _SPEC_PREFILL is not None \
            and _source_sha256(speculative_generate_step) == REVIEWED_SPECULATIVE_SHA256:
        out[_SPEC_PREFILL] = _SPECULATIVE
    return out


def _kv_bits(loop: FrameType) -> bool:
    return loop.f_locals.get("kv_bits") is not None


def dropped_by_caller(frame: FrameType | None, inputs: Any, cache: Any, extra: bool,
                      steps: dict[CodeType, CodeType] | None = None) -> bool:
    """True when ``frame`` (the model call's caller) is a reviewed loop's prefill step
    (generate_step's ``_model_call`` from the loop, speculative_generate_step's ``_prefill``),
    which drops the output, under the conditions the module docstring lists."""
    steps = _steps() if steps is None else steps
    loop = steps.get(frame.f_code) if frame is not None and not extra else None
    outer = frame.f_back if frame is not None else None
    if loop is None or outer is None or outer.f_code is not loop:
        return False  # not a loop's prefill step (generate_step's _step: the logits are used)
    assert frame is not None
    if frame.f_locals.get("input_embeddings") is not None or _kv_bits(outer):
        return False
    return isinstance(inputs, mx.array) and inputs.ndim == 2 and inputs.shape[0] == 1 \
        and isinstance(cache, list) and plain_caches(cache)


class _Held:
    """The steps one run of the loop held back on one cache. Both are the caller's: the cache's
    entries and the loop's progress callback are held weakly (what the loop's frame keeps alive
    while it runs), so an abandoned prompt leaves nothing here."""

    def __init__(self, cache: list[Any], loop: FrameType | None) -> None:
        self.layers = [weakref.ref(c) for c in cache]
        self.loop = id(loop)
        self.thread = threading.get_ident()  # whose stack its loop is on
        # A new function each run of the loop: a dead frame's id can be a new frame's.
        self.fn = weakref.ref(loop.f_locals[_RUN_LOCAL[loop.f_code]]) if loop is not None \
            else lambda: None
        self.steps: list[mx.array] = []
        self.tokens = 0
        self.progress: tuple[Callable[[], Any], int, int] | None = None
        self.stand_in: Callable[[], Any] = lambda: None  # the loop's LoopProgress, weakly

    def of(self, cache: Any) -> bool:
        return isinstance(cache, list) and len(cache) == len(self.layers) \
            and all(r() is c for r, c in zip(self.layers, cache, strict=True))

    def cache(self) -> list[Any] | None:
        out = [r() for r in self.layers]
        return None if any(c is None for c in out) else out

    def alive(self, frame: FrameType | None) -> bool:
        """Its loop still runs: its frame is on the stack ``frame`` is on (the loop never
        yields while it prefills, so a loop off the stack has ended, however it ended)."""
        fn = self.fn()
        if self.thread != threading.get_ident():
            return fn is not None  # another thread's loop: its own calls tell
        while fn is not None and frame is not None:
            if id(frame) == self.loop and frame.f_code in _RUN_LOCAL:
                return frame.f_locals.get(_RUN_LOCAL[frame.f_code]) is fn
            frame = frame.f_back
        return False


def _weak(fn: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(fn)
    except TypeError:  # not weakly referable: kept while its steps are
        return lambda: fn


class Deferral:
    """Held-back prefill steps, each loop's on its cache, run layer-major when output is
    needed; dropped when their loop ends without asking for it."""

    def __init__(self, model: Any, bank: Any, on: bool = True) -> None:
        self.driver: Driver | None = driver_for(model)
        self.bank = bank
        self.on = on and self.driver is not None and loop_reviewed()
        if on and self.driver is not None and not self.on:
            log.warning("prefill runs step by step: mlx_lm.generate_step is not the loop "
                        "reviewed for layer-by-layer prefill (mlx-lm %s)", _mlx_lm_version())
        self.steps = _steps() if self.on else {}
        self.said = Said()  # why a prefill runs step by step, once a reason
        self._chunked = ChunkedLoops()
        self._held: list[_Held] = []
        # Caches a failed pass or an ended loop left part way (by their entries, weakly): why.
        self._unusable: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        # Called with (0, layers) as a pass starts and (layers done, layers) after each layer,
        # before the loop's progress callback hears that layer's share of the pass.
        self.on_layer: Callable[[int, int], None] | None = None
        self.running = False  # a pass is running (the loop's callback hears from each layer)
        self.passes = 0  # layer-major runs
        self.held_steps = 0  # steps held back, in all
        self.dropped_steps = 0  # steps dropped as their loop ended without running them

    @property
    def held(self) -> list[mx.array]:
        """The steps held now, of every cache."""
        return [s for h in self._held for s in h.steps]

    def call(self, forward: Callable[[], mx.array], inputs: mx.array, cache: Any,
             frame: FrameType | None, extra: bool) -> mx.array | None:
        """The model's call: held back (None), or run (with what its cache holds)."""
        if self._held:
            self._drop_ended(frame)
        if len(self._unusable) and isinstance(cache, list):
            self._check_usable(cache)
        if self.on and dropped_by_caller(frame, inputs, cache, extra, self.steps):
            self._hold(inputs, cache, frame)
            return None
        h = next((h for h in self._held if h.of(cache)), None)
        if h is None:
            if self.on:
                self._say(frame, inputs, cache)
            return forward()  # another cache's held steps are not this call's to run
        same = not extra and isinstance(inputs, mx.array) and inputs.ndim == 2 \
            and inputs.shape[0] == 1
        up = frame.f_back if frame is not None else None
        if not (same and frame is not None and frame.f_code in _KNOWN and up is not None
                and h.loop in (id(up), id(up.f_back))):
            h.progress = None  # not the loop's own last step: its callback is not called
        if same:
            return self._run(h, inputs)
        self._run(h)
        return forward()

    def _say(self, frame: FrameType | None, inputs: Any, cache: Any) -> None:
        """Say, once, why a prefill step runs step by step (``prefill_fallback``)."""
        several = isinstance(inputs, mx.array) and inputs.ndim == 2 and inputs.shape[1] > 1
        if frame is None or frame.f_code in _KNOWN or frame.f_code is PREFILL_CHUNKS \
                or batch_step(frame) is not None:
            chunked = None  # mlx-lm's own calls (decode, verify steps) or the batched path
        else:
            chunked = self._chunked.seen(frame, inputs, cache)
        if not several:
            return
        why = loop_reason(frame, self.steps, _KNOWN, _kv_bits)
        if why is None and frame is not None and frame.f_code in self.steps:
            why = cache_reason(cache)  # a loop's prefill step, not held for its caches
        if why is None and chunked is not None:
            why = ("chunked_loop", f"the model is called in a loop of chunks on one cache at "
                                   f"{chunked}: each chunk runs through every layer before the "
                                   f"next; prefill them with {HELPER}, the same calls layer by "
                                   f"layer")
        if why is not None:
            self.said(*why)

    def _hold(self, inputs: mx.array, cache: list[Any], frame: FrameType | None) -> None:
        assert frame is not None and frame.f_back is not None  # dropped_by_caller saw them
        loop = frame.f_back
        h = next((h for h in self._held if h.of(cache)), None)
        if h is not None and h.loop != id(loop):
            self._run(h)  # another running loop's steps on this cache come first
            h = None
        if h is None:
            h = _Held(cache, loop)
            self._held.append(h)
        h.steps.append(inputs)
        h.tokens += int(inputs.shape[1])
        self.held_steps += 1
        h.progress = _loop_progress(loop, len(h.steps) == 1)
        if h.progress is not None and isinstance(h.progress[0](), LoopProgress):
            h.stand_in = h.progress[0]

    def _drop_ended(self, frame: FrameType | None) -> None:
        """Drop the steps of loops that ended without asking for output (an exception from
        their progress callback, Ctrl-C, a closed generator): nobody will, and running them
        for another call would spend that call's reads and call a stopped request's callback."""
        for h in [h for h in self._held if not h.alive(frame)]:
            self._held.remove(h)
            self.dropped_steps += len(h.steps)
            cache = h.cache()
            log.info("prefill: dropped %d held steps (%d tokens) of a loop that ended before "
                     "its last step", len(h.steps), h.tokens)
            if cache is not None:
                self._mark(cache, f"its prefill loop ended with {h.tokens} prompt tokens held "
                                  f"back for a layer-by-layer pass, which were dropped")

    def _mark(self, cache: list[Any], why: str) -> None:
        for c in cache:
            self._unusable[c] = why

    def _check_usable(self, cache: list[Any]) -> None:
        why = next((self._unusable[c] for c in cache if c in self._unusable), None)
        if why is not None:
            raise errors.PromptCacheUnusable(
                f"this prompt cache cannot be used: {why}, so its layers do not hold what "
                f"mlx-lm's loop would leave in them; make a new one "
                f"(mlx_lm.models.cache.make_prompt_cache) and prefill the prompt again")

    def _per_layer(self, h: _Held, at: list[int]) -> Callable[[int, int], None]:
        on_layer, loop = self.on_layer, h.progress
        callback = loop[0]() if loop is not None else None
        stand_in = h.stand_in()
        if stand_in is not None:
            stand_in.holding = False  # the loop's next report comes after the pass

        def both(layer: int, layers: int) -> None:
            at[0] = layer
            if on_layer is not None:
                on_layer(layer, layers)
            if isinstance(callback, LoopProgress):
                callback.layer(layer, layers)
            elif loop is not None and callback is not None:
                callback(loop[1], loop[2])

        return both

    def run_chunks(self, chunks: list[mx.array], cache: list[Any]) -> mx.array:
        """``prefill_chunks``: what the cache holds back (its loop's steps) and ``chunks``, in
        one pass; the last chunk's logits."""
        if self._held:
            self._drop_ended(sys._getframe(1))
        if len(self._unusable):
            self._check_usable(cache)
        h = next((h for h in self._held if h.of(cache)), None) or _Held(cache, None)
        if h in self._held:
            h.progress = None  # its loop's callback: called by its loop only
        else:
            self._held.append(h)
        h.steps += chunks[:-1]
        return self._run(h, chunks[-1])

    def _run(self, h: _Held, last: mx.array | None = None) -> mx.array:
        """Run what ``h`` holds (and ``last``) layer-major; the logits of the last step. A pass
        that fails leaves its cache marked: its layers hold the prompt up to different steps."""
        self._held.remove(h)
        cache = h.cache()
        assert self.driver is not None and cache is not None  # the caller passed it
        steps = h.steps + ([last] if last is not None else [])
        at = [0]
        self.passes += 1
        self.running = True
        try:
            if self.on_layer is not None:
                self.on_layer(0, self.driver.num_layers)
            logits = prefill(self.driver, steps, cache, self.bank, self._per_layer(h, at))
            assert logits is not None
            return logits
        except BaseException as exc:
            self._mark(cache, f"a layer-by-layer prefill pass over it failed after {at[0]} of "
                              f"{self.driver.num_layers} layers ({type(exc).__name__})")
            raise
        finally:
            self.running = False


def _loop_progress(loop: FrameType, first: bool) -> tuple[Callable[[], Any], int, int] | None:
    """The loop's progress callback (held weakly; in its place a ``LoopProgress`` where the
    frame takes one), tokens done once this step returns, tokens in all: heard after each layer
    of the pass, so whatever the callback does per step (the server's keepalive comments) goes
    on during it."""
    f = loop.f_locals
    try:
        callback, total = f["prompt_progress_callback"], int(f["total_prompt_tokens"])
        before = int(f["prompt_processed_tokens"])
        done = before + int(f["n_to_process"])
    except (KeyError, TypeError, ValueError):
        return None
    if not isinstance(callback, LoopProgress):
        stand_in = LoopProgress(callback, before, total)
        if set_local(loop, "prompt_progress_callback", stand_in):
            callback = stand_in
    if isinstance(callback, LoopProgress):
        if first:
            callback.start = before
        callback.end, callback.holding = done, True
    return _weak(callback), done, total


def _mlx_lm_version() -> str:
    import mlx_lm

    return str(getattr(mlx_lm, "__version__", "?"))
