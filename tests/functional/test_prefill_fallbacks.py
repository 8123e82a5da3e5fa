"""Every path that prefills step by step says so once, in the log and as a Python warning
(``PrefillStepByStep``), with the reason and what to do (``prefill_fallback``): a rotating KV
cache (``max_kv_size``, on ``generate_step``'s path and ``batch_generate``'s), the model called
through a wrapper, a copy of mlx-lm's loop, the caller's own loop of chunks. Where it can be
avoided it is: a draft model's prompt is held back and run with its first verify step (one call)
layer by layer, and a caller's chunks run layer by layer through ``prefill_chunks``. Every
logit stays resident mlx-lm's, bitwise.
"""

from __future__ import annotations

import inspect
import logging
import sys
import textwrap
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import batch_generate, generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from cachecd.testbed.tiny_k2 import K2Options, write_tiny_k2
from cachecd.testbed.tiny_model import write_tiny_model
from cachecd_engine import PrefillStepByStep, prefill_chunks
from cachecd_engine.loader import load
from cachecd_engine.local_source import LocalSource, manifest_from_dir
from tests.functional.test_prefill_batched import Tokens
from tests.functional.test_prefill_layer_major import assert_bitwise, cache_arrays

STEP = 16


@pytest.fixture(scope="module", params=["k3", "k2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(f"fallbacks-{request.param}")
    if request.param == "k3":
        full = write_tiny_model(root / "full", seed=0, fmt="fp32")
    else:
        # deepseek_v3 (trimmable, rotating-capable caches); fp8's embeddings keep it fp32.
        full = write_tiny_k2(root / "full", K2Options(fmt="fp8", moe_intermediate=192),
                             seed=0).out
    return request.param, full, manifest_from_dir(full, repo="cachecd/fallbacks"), \
        load_model(full)[0]


@pytest.fixture
def streamed(checkpoint: tuple[str, Path, Any, Any]) -> Iterator[Any]:
    _, full, manifest, _ = checkpoint
    with LocalSource(manifest, full, verify=False) as source:
        model, _ = load(full, source, ram_bytes=1 << 30, prefetch=False)
        model.source = source
        yield model
        model.bank.close()


def _prompt(steps: int = 3) -> list[int]:
    return np.random.default_rng(steps).integers(0, 384, size=steps * STEP + 1).tolist()


def _logits(loop: Any, model: Any, prompt: list[int], **kw: Any) -> list[np.ndarray]:
    seen: list[np.ndarray] = []

    def record(tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(np.array(logits.astype(mx.float32)))
        return logits

    for _ in loop(mx.array(prompt), model, max_tokens=2, prefill_step_size=STEP,
                  logits_processors=[record], **kw):
        pass
    return seen


def _said(caplog: pytest.LogCaptureFixture, reason: str) -> int:
    return sum(f"reason={reason}" in r.getMessage() for r in caplog.records)


def _twice(run: Any, caplog: pytest.LogCaptureFixture, reason: str, match: str) -> Any:
    """Run twice: one warning and one log line, naming what to do, for both."""
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        first = run()
        run()
    ours = [w for w in caught if issubclass(w.category, PrefillStepByStep)]
    assert len(ours) == 1 and match in str(ours[0].message), [str(w.message) for w in ours]
    assert _said(caplog, reason) == 1
    return first


def test_a_rotating_cache_is_said_once(checkpoint: tuple[str, Path, Any, Any], streamed: Any,
                                      caplog: pytest.LogCaptureFixture) -> None:
    kind, _, _, reference = checkpoint
    if kind == "k3":
        pytest.skip("kimi_k3 makes its own caches: max_kv_size does not reach them")
    prompt = _prompt()
    got = _twice(lambda: _logits(generate_step, streamed, prompt, max_kv_size=40), caplog,
                 "rotating_cache", "leave max_kv_size unset")
    assert_bitwise(_logits(generate_step, reference, prompt, max_kv_size=40), got, "logits")
    # And on the batched path (BatchRotatingKVCache).
    caplog.clear()
    _twice(lambda: batch_generate(streamed, Tokens(), [prompt, prompt], max_tokens=1,
                                  prefill_step_size=STEP, max_kv_size=40),
           caplog, "rotating_cache", "max_kv_size")


def test_a_draft_model_prefills_layer_by_layer(checkpoint: tuple[str, Path, Any, Any],
                                              streamed: Any) -> None:
    """speculative_generate_step: the prompt's steps held back and run with the first verify
    step (one call of the last token and the drafts), bitwise; nothing said."""
    kind, _, _, reference = checkpoint
    if kind == "k3":
        pytest.skip("speculative decoding needs trimmable caches: kimi_k3's are not")
    prompt = _prompt(4)

    def run(model: Any) -> list[tuple[int, np.ndarray]]:
        return [(t, np.array(lp.astype(mx.float32))) for t, lp, _ in speculative_generate_step(
            mx.array(prompt), model, reference, num_draft_tokens=2, max_tokens=4,
            prefill_step_size=STEP)]

    want = run(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrefillStepByStep)
        got = run(streamed)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert_bitwise([lp for _, lp in want], [lp for _, lp in got], "logprobs")
    assert streamed.deferral.passes == 1 and streamed.deferral.held_steps == 4


class Wrapper:
    """A caller's wrapper: the model's call inside mlx-lm's loop is the wrapper's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.inner(inputs, cache=cache)


def test_a_wrapped_model_is_said_once(checkpoint: tuple[str, Path, Any, Any], streamed: Any,
                                     caplog: pytest.LogCaptureFixture) -> None:
    _, _, _, reference = checkpoint
    prompt = _prompt()

    def run(model: Any, inner: Any) -> list[np.ndarray]:
        return _logits(generate_step, Wrapper(model), prompt,
                       prompt_cache=make_prompt_cache(inner))

    got = _twice(lambda: run(streamed, streamed), caplog, "wrapped", "unwrapped")
    assert_bitwise(run(reference, reference), got, "logits")


def test_a_copied_loop_is_said_once(checkpoint: tuple[str, Path, Any, Any], streamed: Any,
                                   caplog: pytest.LogCaptureFixture) -> None:
    """mlx-lm's generate_step compiled again (as a caller's copy of it is): another code
    object, so not the loop reviewed."""
    _, _, _, reference = checkpoint
    space = dict(vars(sys.modules["mlx_lm.generate"]))
    exec(compile(textwrap.dedent(inspect.getsource(generate_step)), "copied_loop.py", "exec"),
         space)
    copied = space["generate_step"]
    prompt = _prompt()
    got = _twice(lambda: _logits(copied, streamed, prompt), caplog, "copied_loop",
                 "copied_loop.py")
    assert_bitwise(_logits(generate_step, reference, prompt), got, "logits")


def _chunks(prompt: list[int]) -> list[mx.array]:
    return [mx.array(prompt[i:i + STEP])[None] for i in range(0, len(prompt), STEP)]


def _own_loop(model: Any, prompt: list[int]) -> tuple[np.ndarray, list[Any]]:
    cache = make_prompt_cache(model)
    out = None
    for chunk in _chunks(prompt):
        out = model(chunk, cache=cache)
    assert out is not None
    return np.array(out.astype(mx.float32)), cache


def test_a_callers_own_chunked_loop_is_said_and_prefill_chunks_runs_it_layer_by_layer(
        checkpoint: tuple[str, Path, Any, Any], streamed: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    _, _, _, reference = checkpoint
    prompt = _prompt(5)
    want, want_cache = _own_loop(reference, prompt)
    got, _ = _twice(lambda: _own_loop(streamed, prompt), caplog, "chunked_loop",
                    "prefill_chunks")
    assert_bitwise([want], [got], "own loop")
    # The helper: the same calls layer by layer, one pass, each expert of a layer read once.
    bank, source = streamed.bank, streamed.source
    bank.resize(bank.experts_per_layer * bank.slot_nbytes)
    source.calls.clear()
    cache = make_prompt_cache(streamed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrefillStepByStep)
        logits = prefill_chunks(streamed, _chunks(prompt), cache)
    assert_bitwise([want], [np.array(logits.astype(mx.float32))], "prefill_chunks: logits")
    assert_bitwise(cache_arrays(want_cache), cache_arrays(cache), "prefill_chunks: cache")
    reads = Counter((layer, e) for layer, ids in source.calls for e in ids)
    assert reads and max(reads.values()) == 1


def test_nothing_is_said_where_the_prefill_runs_layer_by_layer(
        checkpoint: tuple[str, Path, Any, Any], streamed: Any) -> None:
    """generate_step's prompts of one step (its last call alone) and of several, and
    batch_generate's (equal and unequal lengths), say nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrefillStepByStep)
        for size in (5, STEP + 5, 3 * STEP + 5):  # one step (its last call alone), two, four
            _logits(generate_step, streamed, _prompt(4)[:size])
        batch_generate(streamed, Tokens(), [_prompt(3), _prompt(3)[:40]], max_tokens=1,
                       prefill_step_size=STEP)
    assert streamed.deferral.passes >= 2 and streamed.ahead.passes >= 1
