"""Prefill layer by layer on mlx-lm's ``BatchGenerator`` path (``batch_generate``, and
``cachecd openai`` when it batches requests), its loop unedited.

``BatchGenerator`` prefills one step per ``next()``: ``_next`` takes up to
``prefill_step_size`` tokens of every prompt in its prompt batch, ``PromptProcessingBatch.prompt``
runs them through ``self.model(tokens, cache=...)``, drops the output and evaluates the caches.
Between two steps it may decode other requests, split off a prompt that is done, take in a new
one, or hand a cache to the server's prompt cache, so a held-back step could be read behind.
So the steps are run ahead instead: at a step whose next steps are known (the generator's own
queue of each row's remaining tokens), that step and those run layer-major on a copy of the
batch's caches, and each step's call then writes into the real caches exactly what the step
writes in mlx-lm's loop (the same ``update_and_fetch`` calls with the same arrays, the same
linear-attention state), reading no expert.

Invariants:
- Only a call from ``PromptProcessingBatch.prompt`` called by ``BatchGenerator._next`` (their
  sources the ones reviewed, ``REVIEWED_SHA256``), over caches that are all
  ``BatchKVCache``/``ArraysCache``, is answered from a pass, and a pass starts only at an
  unpadded one; every other call runs as it would (``forward``), and a rotating cache
  (``max_kv_size``) says so once (``prefill_fallback``).
- A step is answered from a pass only when its tokens are the ones the pass ran and the real
  caches are, object for object, as the pass's previous step left them; anything else (a row
  taken in, split off or removed, a padded step, a cache changed by anyone) drops the pass and
  the call runs step by step: a pass can cost work, never a different bit.
- Such a call returns None (``prompt`` drops it): no number at all to misuse.
- The pass's steps are what ``_next`` will take while its rows stay the same: it stops before a
  row would be split off (its last token left), where a queued request could join the batch,
  and after the first step whose rows' lengths differ. ``prompt`` right-pads that step and calls
  ``prepare`` before it and ``finalize`` after it on every cache: the pass does the same on each
  layer's copy (``_Recording``), and the real call is answered only if ``prepare`` left the real
  caches with exactly that step's lengths and padding.
- The pass keeps, besides the copy of the caches (freed as the pass ends, not left to the
  garbage collector), each step's key/value rows (once the prompt's) and each step's
  linear-attention state, until the step's call. It holds the real caches weakly: what a batch
  that stopped mid-prefill never took goes with its caches (a generator closed or dropped), or
  at the next batched prefill call or the next call on them.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch, _right_pad_prompts
from mlx_lm.models.cache import ArraysCache, BatchKVCache

from cachecd_engine.prefill import Driver, prefill
from cachecd_engine.prefill_fallback import Said, cache_reason

log = logging.getLogger(__name__)

# sha256 of the reviewed sources (mlx-lm 0.32.2): ``prompt`` drops the model's output and reads
# the caches only through ``prepare`` (padded steps), ``c.state`` and ``finalize``; ``_next``
# takes each row's next ``min(len(segment), prefill_step_size)`` tokens, splits off rows whose
# last token is all that is left, and takes in queued requests, before the step.
REVIEWED_SHA256 = {
    "prompt": "91194fe0a4fcd146f598aa99ee66f7edf78176f7d0ec368117d749f6b7f970dc",
    "_next": "eb3a4e361dc2c19eafd28e901155828fd4602d63e26c431ca9ffbf079302c665",
}

_PROMPT: CodeType = PromptProcessingBatch.prompt.__code__
_NEXT: CodeType = BatchGenerator._next.__code__


def source_sha256(fn: Callable[..., Any]) -> str | None:
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    except (OSError, TypeError):
        return None


def loop_reviewed() -> bool:
    """mlx-lm's batch prefill is the one reviewed here (answering from a pass is safe)."""
    return source_sha256(PromptProcessingBatch.prompt) == REVIEWED_SHA256["prompt"] \
        and source_sha256(BatchGenerator._next) == REVIEWED_SHA256["_next"]


def batch_step(frame: FrameType | None) -> tuple[Any, Any, bool] | None:
    """(prompt batch, generator, padded) when ``frame`` (the model call's caller) is a prefill
    step of ``BatchGenerator``; None otherwise."""
    if frame is None or frame.f_code is not _PROMPT:
        return None
    outer = frame.f_back
    if outer is None or outer.f_code is not _NEXT:
        return None
    padding = frame.f_locals.get("max_padding")
    if not isinstance(padding, int):
        return None
    return frame.f_locals["self"], outer.f_locals["self"], padding > 0


def batch_caches(cache: Any) -> bool:
    """Non-empty, and only the batch caches a pass replays: ``BatchKVCache`` (its
    ``update_and_fetch`` calls) and ``ArraysCache`` (its state)."""
    return isinstance(cache, list) and bool(cache) \
        and all(type(c) in (BatchKVCache, ArraysCache) for c in cache)


def next_steps(generator: Any, step_size: int) -> list[list[list[int]]]:
    """The prompt batch's next steps as ``_next`` will take them, while its rows stay the same
    (each a list of rows' tokens): up to the first whose rows' lengths differ (``prompt`` pads
    it, and after it a row whose prompt ended leaves the batch), that one included."""
    if generator._unprocessed_sequences:  # the next _next may take one in: rows change
        return []
    rows = [[list(s) for s in seq[0]] for seq in generator._currently_processing]
    steps: list[list[list[int]]] = []
    while rows and all(r and not (len(r) == 1 and len(r[0]) == 1) for r in rows):
        take = [r[0][:step_size] for r in rows]
        steps.append(take)
        if len({len(t) for t in take}) != 1:
            break  # rows of unequal lengths: a padded step, after which rows may leave
        for r, t in zip(rows, take, strict=True):
            r[0] = r[0][len(t):]
            if not r[0]:
                r.pop(0)
    return steps


def padded(step: list[list[int]]) -> tuple[list[int], list[int]] | None:
    """(lengths, right padding) ``prompt`` prepares the caches with for a step whose rows'
    lengths differ; None for an unpadded step."""
    lengths = [len(t) for t in step]
    if len(set(lengths)) == 1:
        return None
    return lengths, [max(lengths) - n for n in lengths]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is b or (isinstance(a, (int, float, type(None))) and type(a) is type(b) and a == b)


def _frozen(a: Any) -> Any:
    """A copy of a cache's small array (offsets, paddings, lengths), which mlx-lm's caches
    change in place (``-=``): a later in-place change does not reach the copy."""
    return mx.array(a) if isinstance(a, mx.array) else a


def _fingerprint(cache: list[Any]) -> list[dict[str, Any]]:
    """Every attribute of every cache, lists copied, and the values of its 1-D arrays (changed
    in place): what a later call checks, object for object, to know nobody changed the caches
    since. The key/value buffers change in place only in ``update_and_fetch``, which moves
    ``_idx``, an int."""
    return [{k: list(v) if isinstance(v, list) else
             (v, np.array(v)) if isinstance(v, mx.array) and v.ndim <= 1 else v
             for k, v in vars(c).items()} for c in cache]


def _same_attr(v: Any, s: Any) -> bool:
    if isinstance(s, tuple) and isinstance(v, mx.array):
        return v is s[0] and np.array_equal(np.array(v), s[1])
    return _same(v, s)


# What ``prepare`` sets for a padded step, by cache type: the only attribute it changes.
_PREPARED = {BatchKVCache: "_right_padding", ArraysCache: "lengths"}


def _unchanged(cache: list[Any], seen: list[dict[str, Any]],
               prepared: tuple[list[int], list[int]] | None = None) -> bool:
    """Every cache as ``seen``; for a padded step, but for what ``prepare`` set, which must be
    the step's (lengths, right padding)."""
    def same(c: Any, k: str, v: Any, s: Any) -> bool:
        if prepared is None or k != _PREPARED.get(type(c)):
            return _same_attr(v, s)
        want = prepared[0] if k == "lengths" else prepared[1]
        return isinstance(v, mx.array) and np.array_equal(np.array(v), want)

    return len(cache) == len(seen) and all(
        vars(c).keys() == s.keys() and all(same(c, k, v, s[k]) for k, v in vars(c).items())
        for c, s in zip(cache, seen, strict=True))


@dataclass
class Pass:
    """Steps run ahead on a copy of one prompt batch's caches, replayed a step a call."""

    layers: list[weakref.ref[Any]]  # the real caches (the batch's: held weakly)
    tokens: list[np.ndarray]  # each step's tokens [B, n], the first already replayed
    writes: list[list[Any]]  # per step, per layer: update_and_fetch args, or ArraysCache state
    prepared: list[tuple[list[int], list[int]] | None]  # per step: ``padded``'s
    done: int = 0  # steps replayed
    seen: list[dict[str, Any]] = field(default_factory=list)
    forget: Any = None  # the finalizer that drops the pass when its caches go

    def of(self, cache: Any) -> bool:
        return isinstance(cache, list) and len(cache) == len(self.layers) \
            and all(r() is c for r, c in zip(self.layers, cache, strict=True))

    def replay(self, cache: list[Any]) -> None:
        """Write step ``done``'s cache updates into the real caches, as its call would."""
        for c, w in zip(cache, self.writes[self.done], strict=True):
            if isinstance(c, ArraysCache):
                state, c.left_padding, c.lengths = w
                for k, a in enumerate(state):
                    c[k] = a
            else:
                for args in w:
                    c.update_and_fetch(*args)
        self.writes[self.done] = []  # the real caches hold them now
        self.done += 1
        self.seen = _fingerprint(cache)

    def answers(self, inputs: mx.array, cache: Any) -> bool:
        return self.of(cache) and self.done < len(self.tokens) \
            and _unchanged(cache, self.seen, self.prepared[self.done]) \
            and np.array_equal(np.array(inputs), self.tokens[self.done])


class _Recording:
    """A pass's copy of a batch's caches, recording what each step writes into each layer's:
    a ``BatchKVCache``'s ``update_and_fetch`` calls, an ``ArraysCache``'s state; a padded step's
    ``prepare`` and ``finalize`` called around it, as ``prompt`` calls them."""

    def __init__(self, cache: list[Any], steps: int,
                 prepared: list[tuple[list[int], list[int]] | None]) -> None:
        self.shadow = copy.deepcopy(cache)
        self.writes: list[list[Any]] = [[[] for _ in cache] for _ in range(steps)]
        self.prepared = prepared
        self.at = 0  # the step running
        for i, c in enumerate(self.shadow):
            if isinstance(c, BatchKVCache):
                c.update_and_fetch = self._recorder(c, i)  # type: ignore[method-assign]

    def _recorder(self, c: Any, i: int) -> Callable[..., Any]:
        update = c.update_and_fetch

        def record(*args: mx.array) -> Any:
            self.writes[self.at][i].append(args)
            return update(*args)

        return record

    def after(self, layer: int, step: int) -> list[mx.array]:
        """``prefill``'s ``after``: step ``step``'s writes into layer ``layer``'s cache kept;
        the arrays to evaluate with the layer."""
        steps = len(self.writes)
        self.at = step + 1 if step + 1 < steps else 0
        c = self.shadow[layer]
        if isinstance(c, ArraysCache):
            self.writes[step][layer] = (list(c.cache), _frozen(c.left_padding),
                                        _frozen(c.lengths))
            state: list[Any] = c.cache
            kept = [a for a in state if a is not None]
        else:
            kept = [a for args in self.writes[step][layer] for a in args]
        # A padded step's ``prepare`` and ``finalize`` on this layer's cache: after the step
        # before it has written, after it has.
        if self.prepared[step] is not None:
            c.finalize()
        nxt = self.prepared[step + 1] if step + 1 < steps else None
        if nxt is not None:
            c.prepare(lengths=nxt[0], right_padding=nxt[1])
        return kept

    def close(self) -> None:
        """The recorders refer to their caches (a cycle): without them the copy, the whole
        prompt's KV, goes now, not when the collector next runs."""
        for c in self.shadow:
            c.__dict__.pop("update_and_fetch", None)
        self.shadow.clear()


def _forget(ahead: weakref.ref[BatchAhead], p: weakref.ref[Pass]) -> None:
    a = ahead()
    if a is not None and a.current is not None and a.current is p():
        a.current = None


class BatchAhead:
    """The streamed model's prefill steps on ``BatchGenerator``'s path, run ahead layer-major."""

    def __init__(self, driver: Driver | None, bank: Any, on: bool = True) -> None:
        self.driver, self.bank = driver, bank
        self.on = on and driver is not None and loop_reviewed()
        if on and driver is not None and not self.on:
            log.warning("BatchGenerator's prefill runs step by step: its loop is not the one "
                        "reviewed for layer-by-layer prefill")
        self._current: Pass | None = None
        self.said = Said()  # why a prefill runs step by step, once a reason
        self.passes = 0  # layer-major runs
        self.replayed = 0  # steps answered from a pass
        self.padded = 0  # padded steps among them
        self.running = False
        # Called with (0, layers) as a pass starts and (layers done, layers) after each layer.
        self.on_layer: Callable[[int, int], None] | None = None
        # Called after each layer with the rows' (uid, (tokens done, tokens in all)), as the
        # generator reports them once the step returns (the server's keepalives).
        self.on_rows: Callable[[list[tuple[int, tuple[int, int]]]], None] | None = None

    @property
    def current(self) -> Pass | None:
        """The pass whose steps are being replayed, if any."""
        return self._current

    @current.setter
    def current(self, p: Pass | None) -> None:
        old, self._current = self._current, p
        if old is not None and old is not p and old.forget is not None:
            old.forget.detach()
        if p is not None and p.forget is None:
            first = p.layers[0]()
            # The batch's caches go (a generator closed or dropped mid-prefill): the steps run
            # ahead for them go too, not at some later call.
            p.forget = weakref.finalize(first, _forget, weakref.ref(self), weakref.ref(p))

    def call(self, forward: Callable[[], mx.array], inputs: Any, cache: Any,
             frame: FrameType | None, extra: bool) -> mx.array | None:
        """The model's call: answered from a pass (None), or run."""
        found = batch_step(frame) if self.on and not extra else None
        if found is not None and isinstance(inputs, mx.array) and not batch_caches(cache):
            why = cache_reason(cache, batched=True)
            if why is not None and not found[2] and inputs.shape[1] > 1:
                self.said(*why, stacklevel=6)
        if found is None or not isinstance(inputs, mx.array) or not batch_caches(cache):
            if self.current is not None and self.current.of(cache):
                self.current = None  # another call on its caches: they move on without it
            return forward()
        if self.current is not None and self.current.answers(inputs, cache):
            self.padded += self.current.prepared[self.current.done] is not None
            self.current.replay(cache)
            self.replayed += 1
            if self.current.done == len(self.current.tokens):
                self.current = None
            return None
        self.current = None  # its rows or its caches changed: run step by step from here
        batch, generator, pads = found
        steps = next_steps(generator, batch.prefill_step_size) if not pads else []
        if not steps:
            return forward()
        self.current = self._run(np.array(inputs), steps, cache, batch, generator)
        self.current.replay(cache)
        return None

    def _run(self, first: np.ndarray, steps: list[list[list[int]]], cache: list[Any],
             batch: Any, generator: Any) -> Pass:
        """Run ``first`` and ``steps`` layer-major on a copy of ``cache``, keeping what each
        step writes into each layer's cache."""
        assert self.driver is not None
        tokens = [first] + [np.array(_right_pad_prompts(s), dtype=first.dtype) for s in steps]
        prepared: list[tuple[list[int], list[int]] | None] = [None]
        rec = _Recording(cache, len(tokens), prepared + [padded(s) for s in steps])
        self.passes += 1
        self.running = True
        try:
            if self.on_layer is not None:
                self.on_layer(0, self.driver.num_layers)
            prefill(self.driver, [mx.array(t) for t in tokens], rec.shadow, self.bank,
                    self._per_layer(batch, generator), logits=False, after=rec.after)
        finally:
            self.running = False
            rec.close()
        return Pass([weakref.ref(c) for c in cache], tokens, rec.writes, rec.prepared)

    def _per_layer(self, batch: Any, generator: Any) -> Callable[[int, int], None]:
        rows = [(uid, (int(seq[1]), int(seq[2])))
                for uid, seq in zip(batch.uids, generator._currently_processing,
                                         strict=True)]
        on_layer, on_rows = self.on_layer, self.on_rows

        def both(layer: int, layers: int) -> None:
            if on_layer is not None:
                on_layer(layer, layers)
            if on_rows is not None:
                on_rows(rows)

        return both
