"""Prefill layer by layer through mlx-lm's own loop (``mlx_lm.stream_generate``), exactly.

The streamed model holds back the prefill steps ``generate_step`` drops the output of and runs
them, with the last step, layer by layer (``cachecd_engine.prefill_defer``). For prompts of 1, 2
and 5 steps at two step sizes, in every format the exactness tests cover (mxfp4 and plain K3,
int4 and fp8 K2), every logit the loop computes and every cache tensor after it are bitwise
resident mlx-lm's at the same step size. With a pool of one layer's experts, a prompt of
several steps reads each routed expert of each layer once (step by step reads them again each
step).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from cachecd import errors
from cachecd.testbed.tiny_k2 import K2Options, write_tiny_k2
from cachecd.testbed.tiny_model import write_tiny_model
from cachecd_engine.loader import load
from cachecd_engine.local_source import LocalSource, manifest_from_dir

STEP_SIZES = (16, 7)
STEPS = (1, 2, 5)
DECODE = 3


@pytest.fixture(scope="module", params=["mxfp4", "fp32", "int4", "fp8"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(f"layer-major-{request.param}")
    if request.param in ("mxfp4", "fp32"):
        full = write_tiny_model(root / "full", seed=0, fmt=request.param)
    elif request.param == "int4":
        full = write_tiny_k2(root / "full", K2Options(), seed=0).out
    else:
        full = write_tiny_k2(root / "full", K2Options(fmt="fp8", moe_intermediate=192),
                             seed=0).out
    manifest = manifest_from_dir(full, repo=f"cachecd/layer-major-{request.param}")
    reference, _ = load_model(full)
    return full, manifest, reference


def generate(model: Any, prompt: list[int], step: int) -> tuple[list[np.ndarray], list[Any]]:
    """Every logit mlx-lm's loop computes for the prompt and ``DECODE`` greedy tokens (as its
    logits processors see them), and the cache after it."""
    seen: list[np.ndarray] = []

    def record(tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(np.array(logits.astype(mx.float32)))
        return logits

    cache = make_prompt_cache(model)
    for _ in generate_step(mx.array(prompt), model, max_tokens=DECODE, prefill_step_size=step,
                           prompt_cache=cache, logits_processors=[record]):
        pass
    return seen, cache


def cache_arrays(cache: list[Any]) -> list[np.ndarray]:
    out = []
    for c in cache:
        for _, a in tree_flatten(c.state):
            if isinstance(a, mx.array):
                out.append(np.array(a.view(mx.uint8)))
            elif a is not None:  # an int in some caches' state
                out.append(np.array([a]))
        out.append(np.array([getattr(c, "offset", -1)]))
    return out


def assert_bitwise(ref: list[np.ndarray], got: list[np.ndarray], what: str) -> None:
    assert len(ref) == len(got), what
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8)), \
            f"{what} {i}: max |diff| = {float(np.max(np.abs(a - b)))}"


def test_bitwise_through_mlx_lm_loop(checkpoint: tuple[Path, Any, Any]) -> None:
    full, manifest, reference = checkpoint
    rng = np.random.default_rng(1)
    with LocalSource(manifest, full, verify=False) as source:
        model, _ = load(full, source, ram_bytes=1 << 30, prefetch=False)
        deferral = model.deferral
        assert deferral.on, "layer-major prefill must be on for this model type"
        for step in STEP_SIZES:
            for steps in STEPS:
                prompt = rng.integers(0, 384, size=steps * step + 1).tolist()
                ref_logits, ref_cache = generate(reference, prompt, step)
                passes, held = deferral.passes, deferral.held_steps
                logits, cache = generate(model, prompt, step)
                what = f"step {step} x {steps}"
                assert deferral.passes == passes + 1 and deferral.held_steps == held + steps, what
                assert len(logits) == DECODE + 1
                assert_bitwise(ref_logits, logits, f"{what}: logits")
                assert_bitwise(cache_arrays(ref_cache), cache_arrays(cache), f"{what}: cache")
        model.bank.close()


def test_one_read_per_expert_with_a_pool_of_one_layer(checkpoint: tuple[Path, Any, Any]) -> None:
    """Each routed expert of each layer is read at most once for a prompt of 5 steps, with a
    pool that holds one layer's experts; step by step (the old way) reads some again."""
    full, manifest, _ = checkpoint
    prompt = np.random.default_rng(2).integers(0, 384, size=5 * 16 + 1).tolist()
    reads = {}
    for layer_major in (True, False):
        with LocalSource(manifest, full, verify=False) as source:
            model, _ = load(full, source, ram_bytes=1, prefetch=False, speculate=False,
                            layer_major=layer_major)
            bank = model.bank
            bank.resize(bank.experts_per_layer * bank.slot_nbytes)
            assert bank.capacity == bank.experts_per_layer
            cache = make_prompt_cache(model)
            # The prefill alone: the loop's steps, then the last token's step (max_tokens=0).
            for _ in generate_step(mx.array(prompt), model, max_tokens=0, prefill_step_size=16,
                                   prompt_cache=cache):
                pass
            reads[layer_major] = Counter((layer, e) for layer, ids in source.calls for e in ids)
            assert bank.stats.experts_routed > bank.experts_per_layer
            model.bank.close()
    once = reads[True]
    assert once and max(once.values()) == 1, f"read twice: {[k for k, n in once.items() if n > 1]}"
    # The same experts are routed to either way, but for the last layer's of the steps before
    # the last, which layer by layer does not read (nothing uses that output).
    assert set(once) < set(reads[False])
    assert sum(reads[False].values()) > sum(once.values())  # step by step reads some again


def test_an_unreviewed_loop_runs_step_by_step(checkpoint: tuple[Path, Any, Any],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Another mlx-lm's generate_step (its source not the one reviewed): nothing is held back,
    mlx-lm's loop runs as it is, and the numbers are still mlx-lm's."""
    from cachecd_engine import prefill_defer

    full, manifest, reference = checkpoint
    monkeypatch.setattr(prefill_defer, "REVIEWED_SHA256", "0" * 64)
    prompt = np.random.default_rng(3).integers(0, 384, size=2 * 16 + 1).tolist()
    with LocalSource(manifest, full, verify=False) as source:
        model, _ = load(full, source, ram_bytes=1 << 30, prefetch=False)
        assert not model.deferral.on
        ref_logits, ref_cache = generate(reference, prompt, 16)
        logits, cache = generate(model, prompt, 16)
        assert model.deferral.held_steps == 0 and model.deferral.passes == 0
        assert_bitwise(ref_logits, logits, "logits")
        assert_bitwise(cache_arrays(ref_cache), cache_arrays(cache), "cache")
        model.bank.close()


class Stop(Exception):
    pass


def test_an_interrupted_prefills_cache_is_refused(checkpoint: tuple[Path, Any, Any]) -> None:
    """The loop's progress callback raises once it hears two steps' tokens (during the pass:
    a held step reports nothing): the pass stops part way, and its cache, whose layers hold
    the prompt up to different steps, is refused with a typed error rather than read
    (tests/functional/test_prefill_abandoned.py: nothing else is left behind)."""
    full, manifest, _ = checkpoint
    prompt = np.random.default_rng(4).integers(0, 384, size=4 * 16 + 1).tolist()

    def stop(done: int, total: int) -> None:
        if done >= 2 * 16:
            raise Stop

    with LocalSource(manifest, full, verify=False) as source:
        model, _ = load(full, source, ram_bytes=1 << 30, prefetch=False)
        cache = make_prompt_cache(model)
        with pytest.raises(Stop):
            for _ in generate_step(mx.array(prompt), model, prefill_step_size=16,
                                   prompt_cache=cache, prompt_progress_callback=stop):
                pass
        assert model.deferral.held_steps == 4 and model.deferral.passes == 1
        with pytest.raises(errors.PromptCacheUnusable):
            model(mx.array(prompt[:5])[None], cache=cache)
        model.bank.close()


def test_the_loop_hears_from_each_layer(checkpoint: tuple[Path, Any, Any]) -> None:
    """The loop's progress callback (a library caller's, the server's keepalive comments) hears
    steady progress: nothing for a held step (no work done yet), then after each layer of the
    pass the tokens that share of the pass stands for, then the loop's own last report; never
    the last held step's figure at once and again each layer."""
    full, manifest, _ = checkpoint
    prompt = np.random.default_rng(5).integers(0, 384, size=3 * 16 + 1).tolist()
    heard: list[tuple[int, int]] = []
    with LocalSource(manifest, full, verify=False) as source:
        model, _ = load(full, source, ram_bytes=1 << 30, prefetch=False)
        layers = model.deferral.driver.num_layers
        for _ in generate_step(mx.array(prompt), model, max_tokens=1, prefill_step_size=16,
                               prompt_progress_callback=lambda d, t: heard.append((d, t)),
                               prompt_cache=make_prompt_cache(model)):
            pass
        model.bank.close()
    total = len(prompt)
    assert heard == [(0, total)] + [(48 * n // layers, total) for n in range(1, layers + 1)] \
        + [(total, total)]
    assert [d for d, _ in heard] == sorted(d for d, _ in heard)


def _small_pool(model: Any, fraction: int) -> Any:
    bank = model.bank
    bank.resize(max(2, bank.experts_per_layer // fraction) * bank.slot_nbytes)
    assert bank.capacity < bank.experts_per_layer and bank.groups_chunks()
    return bank


def _grouped(model: Any, together: bool) -> Any:
    """A pool of a third of a layer, a prefill pass's window as large as it gets, and the
    layer's steps taken together (``pool.chunks``) or each call in turn (the way before)."""
    bank = _small_pool(model, 3)
    bank.window_nbytes = 1 << 40
    if not together:
        bank.groups_chunks = lambda: False
    return bank


def test_a_pool_smaller_than_a_layer_reads_each_expert_once(
        checkpoint: tuple[Path, Any, Any]) -> None:
    """A pool of a third of a layer's experts: a prompt of 5 steps reads each routed expert of
    each layer once (the layer's calls of every step computed together, each group of experts
    read once for all their rows), and its logits and cache are bitwise mlx-lm's; in turn (the
    way before) reads some again. In windows of one step the answer is the same."""
    full, manifest, reference = checkpoint
    rng = np.random.default_rng(6)
    reads = {}
    for together in (True, False):
        with LocalSource(manifest, full, verify=False) as source:
            model, _ = load(full, source, ram_bytes=1, prefetch=False, speculate=False)
            _grouped(model, together)
            prompt = rng.integers(0, 384, size=5 * 16 + 1).tolist()
            for _ in generate_step(mx.array(prompt), model, max_tokens=0, prefill_step_size=16,
                                   prompt_cache=make_prompt_cache(model)):
                pass
            reads[together] = Counter((layer, e) for layer, ids in source.calls for e in ids)
            model.bank.close()
    once = reads[True]
    assert once and max(once.values()) == 1, f"read twice: {[k for k, n in once.items() if n > 1]}"
    assert sum(reads[False].values()) > sum(once.values())

    with LocalSource(manifest, full, verify=False) as source:
        model, _ = load(full, source, ram_bytes=1, prefetch=False, speculate=False)
        bank = _small_pool(model, 3)
        for window, step, steps in ((1 << 40, 16, 5), (1 << 40, 7, 2), (1, 16, 3)):
            bank.window_nbytes = window
            prompt = rng.integers(0, 384, size=steps * step + 1).tolist()
            ref_logits, ref_cache = generate(reference, prompt, step)
            logits, cache = generate(model, prompt, step)
            what = f"window {window}, step {step} x {steps}"
            assert_bitwise(ref_logits, logits, f"{what}: logits")
            assert_bitwise(cache_arrays(ref_cache), cache_arrays(cache), f"{what}: cache")
        model.bank.close()
