"""A layer-by-layer prefill that stops part way leaves nothing behind (``prefill_defer``).

A prompt cancelled from mlx-lm's progress callback (it raises during the pass) or by Ctrl-C
while its steps are held leaves no held step, cache or callback in the engine: the next prompt on a new cache reads what a fresh
model reads, never calls the old callback, and its logits are resident mlx-lm's, bitwise. The
cancelled cache, whose held steps were dropped, is refused with a typed error, as is a cache a
failed pass (a read error at a layer) left with its layers at different tokens.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from cachecd import errors
from cachecd.testbed.tiny_model import write_tiny_model
from cachecd_engine.loader import load
from cachecd_engine.local_source import LocalSource, manifest_from_dir
from cachecd_engine.streamed_moe import StreamedSwitchGLU
from tests.functional.test_prefill_layer_major import assert_bitwise, generate

STEP = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    full = write_tiny_model(tmp_path_factory.mktemp("abandoned") / "full", seed=0, fmt="fp32")
    return full, manifest_from_dir(full, repo="cachecd/abandoned"), load_model(full)[0]


def _model(full: Path, source: LocalSource) -> Any:
    """A pool of one layer's experts: each prompt's reads are its own, whatever ran before."""
    model, _ = load(full, source, ram_bytes=1, prefetch=False, speculate=False)
    bank = model.bank
    bank.resize(bank.experts_per_layer * bank.slot_nbytes)
    return model


class Stop(Exception):
    pass


def _prompts() -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(7)
    return rng.integers(0, 384, size=4 * STEP + 1).tolist(), \
        rng.integers(0, 384, size=3 * STEP + 1).tolist()


def _fresh_reads(full: Path, manifest: Any, prompt: list[int]) -> list[tuple[int, list[int]]]:
    with LocalSource(manifest, full, verify=False) as source:
        model = _model(full, source)
        generate(model, prompt, STEP)
        model.bank.close()
        return list(source.calls)


def _interrupt_held_steps(monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """Ctrl-C while the loop holds steps: a KeyboardInterrupt from the loop's evaluation of its
    ``after``-th step's caches (between held steps: nothing has run)."""
    real, seen = mx.eval, [0]

    def evaluate(*args: Any) -> Any:
        if sys._getframe(1).f_code is generate_step.__code__:
            seen[0] += 1
            if seen[0] == after:
                raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(mx, "eval", evaluate)


@pytest.mark.parametrize("stop", ["callback every time", "callback once", "ctrl-c held"])
def test_a_cancelled_prefill_leaves_nothing_for_the_next_prompt(
        checkpoint: tuple[Path, Any, Any], stop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The callback raises once it hears the second step's tokens (during the pass: held steps
    report nothing), always or once; or Ctrl-C comes while two steps are held. The next prompt,
    on a new cache, raises nothing, reads no more than a fresh model (none of the cancelled
    prompt's steps), never calls the old callback, and its logits are mlx-lm's."""
    full, manifest, reference = checkpoint
    cancelled, prompt = _prompts()
    fresh = _fresh_reads(full, manifest, prompt)
    error: type[BaseException] = KeyboardInterrupt if stop == "ctrl-c held" else Stop
    heard: list[tuple[int, int]] = []

    def callback(done: int, total: int) -> None:
        heard.append((done, total))
        if stop != "ctrl-c held" and done >= 2 * STEP and (stop != "callback once"
                                                          or len(heard) == 1 + 3):
            raise error

    with LocalSource(manifest, full, verify=False) as source:
        model = _model(full, source)
        cache = make_prompt_cache(model)
        with monkeypatch.context() as patch:
            if stop == "ctrl-c held":
                _interrupt_held_steps(patch, 2)
            with pytest.raises(error):
                for _ in generate_step(mx.array(cancelled), model, prefill_step_size=STEP,
                                       prompt_cache=cache, prompt_progress_callback=callback):
                    pass
        gone = weakref.ref(cache[0]), weakref.ref(callback)
        calls, before = len(heard), len(source.calls)
        ref_logits, _ = generate(reference, prompt, STEP)
        logits, _ = generate(model, prompt, STEP)  # a new prompt on a new cache
        assert len(heard) == calls, "the cancelled request's callback was called again"
        reads = Counter((layer, e) for layer, ids in source.calls[before:] for e in ids)
        want = Counter((layer, e) for layer, ids in fresh for e in ids)
        assert not reads - want, "the next prompt paid for the cancelled one"
        assert_bitwise(ref_logits, logits, "logits after a cancel")
        assert model.deferral.held == []
        if stop == "ctrl-c held":
            assert model.deferral.dropped_steps == 2 and before == 0
        # The cancelled cache lacks steps mlx-lm's would hold: refused, not read.
        with pytest.raises(errors.PromptCacheUnusable, match="make_prompt_cache"):
            model(mx.array(prompt[:3])[None], cache=cache)
        del cache, callback
        gc.collect()
        assert [r() for r in gone] == [None, None], "the engine keeps the cancelled prompt"
        model.bank.close()


class Injected(Exception):
    pass


@pytest.mark.parametrize("error", [Injected, KeyboardInterrupt], ids=["read error", "ctrl-c"])
def test_a_pass_failing_at_a_layer_marks_its_cache(checkpoint: tuple[Path, Any, Any],
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   error: type[BaseException]) -> None:
    """A read error, or Ctrl-C, at the third MoE layer of a pass: the cache's layers hold the
    prompt up to different steps, so reusing it raises a typed error naming what to do (it gave
    wrong logits silently); a new cache on the same model is bitwise mlx-lm's."""
    full, manifest, reference = checkpoint
    cancelled, prompt = _prompts()
    with LocalSource(manifest, full, verify=False) as source:
        model = _model(full, source)
        moe = sorted(m.layer for _, m in model.named_modules()
                     if isinstance(m, StreamedSwitchGLU))
        real = source.read_into

        def read_into(layer, ids, targets, landed=None):  # type: ignore[no-untyped-def]
            if layer == moe[2]:
                raise error(f"layer {layer}")
            return real(layer, ids, targets, landed)

        monkeypatch.setattr(source, "read_into", read_into)
        cache = make_prompt_cache(model)
        with pytest.raises(error):
            for _ in generate_step(mx.array(cancelled), model, prefill_step_size=STEP,
                                   prompt_cache=cache):
                pass
        offsets = {getattr(c, "offset", None) for c in cache} - {None}
        assert len(offsets) > 1  # skewed: why it must not be read
        monkeypatch.setattr(source, "read_into", real)
        with pytest.raises(errors.PromptCacheUnusable, match=rf"failed after {moe[2]} of {len(model.layers)} layers"):
            for _ in generate_step(mx.array(prompt), model, prefill_step_size=STEP,
                                   prompt_cache=cache):
                pass
        ref_logits, _ = generate(reference, prompt, STEP)
        logits, _ = generate(model, prompt, STEP)
        assert_bitwise(ref_logits, logits, "logits after a failed pass")
        model.bank.close()
