"""Prefill layer by layer through mlx-lm's ``batch_generate`` (its ``BatchGenerator``), exactly.

The streamed model runs the prompt batch's known next steps ahead, layer-major, on a copy of
its caches, and each step's call writes what that step writes (``cachecd_engine.prefill_batch``).
For prompts of 1, 2 and 5 steps at two step sizes, alone and batched together (rows of unequal
lengths: padded steps, rows split off mid-batch), every logit the generator samples from, every
token and every returned cache are bitwise resident mlx-lm's ``batch_generate`` at the same step
size. With a pool of one layer's experts, each routed expert of each layer is read once for a
prompt batch of 5 steps (step by step: again each step).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import batch_generate
from mlx_lm.utils import load_model

from cachecd.testbed.tiny_k2 import K2Options, write_tiny_k2
from cachecd.testbed.tiny_model import write_tiny_model
from cachecd_engine.loader import load
from cachecd_engine.local_source import LocalSource, manifest_from_dir
from tests.functional.test_prefill_layer_major import _grouped, assert_bitwise, cache_arrays

STEP_SIZES = (16, 7)
STEPS = (1, 2, 5)
DECODE = 3


class Tokens:
    """What batch_generate asks of a tokenizer: stop tokens (none here) and a decode."""

    eos_token_ids: list[int] = []

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


@pytest.fixture(scope="module", params=["fp32", "int4"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(f"batched-{request.param}")
    if request.param == "fp32":
        full = write_tiny_model(root / "full", seed=0, fmt="fp32")
    else:
        full = write_tiny_k2(root / "full", K2Options(), seed=0).out
    manifest = manifest_from_dir(full, repo=f"cachecd/batched-{request.param}")
    reference, _ = load_model(full)
    return full, manifest, reference


def generate(model: Any, prompts: list[list[int]], step: int,
             ) -> tuple[list[np.ndarray], list[list[int]], list[np.ndarray]]:
    """Every row's logits the generator samples from (in the order it samples), the tokens,
    and each prompt's cache after it."""
    seen: list[np.ndarray] = []

    def record(tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(np.array(logits.astype(mx.float32)))
        return logits

    out = batch_generate(model, Tokens(), prompts, max_tokens=DECODE, prefill_step_size=step,
                         logits_processors=[record], return_token_ids=True,
                         return_prompt_caches=True)
    assert out.token_ids is not None and out.caches is not None
    return seen, out.token_ids, [a for c in out.caches for a in cache_arrays(c)]


def test_bitwise_through_batch_generate(checkpoint: tuple[Path, Any, Any]) -> None:
    full, manifest, reference = checkpoint
    rng = np.random.default_rng(1)
    with LocalSource(manifest, full, verify=False) as source:
        model, _ = load(full, source, ram_bytes=1 << 30, prefetch=False)
        ahead = model.ahead
        assert ahead.on, "layer-major prefill must be on for this model type"
        for step in STEP_SIZES:
            prompts = [rng.integers(0, 384, size=s * step + 1).tolist() for s in STEPS]
            for batch in ([p] for p in prompts):
                passes, replayed = ahead.passes, ahead.replayed
                ref_logits, ref_tokens, ref_cache = generate(reference, batch, step)
                logits, tokens, cache = generate(model, batch, step)
                steps = (len(batch[0]) - 1) // step
                what = f"step {step} x {steps}"
                # One pass for the prompt's steps: its first runs them, the others replay.
                assert ahead.passes == passes + (steps > 1), what
                assert ahead.replayed == replayed + max(steps - 1, 0), what
                assert tokens == ref_tokens and len(tokens[0]) == DECODE, what
                assert_bitwise(ref_logits, logits, f"{what}: logits")
                assert_bitwise(ref_cache, cache, f"{what}: cache")
            # All three at once: padded steps and rows split off as their prompts end run
            # step by step, the 5-step prompt's last steps alone layer by layer.
            ref_logits, ref_tokens, ref_cache = generate(reference, prompts, step)
            logits, tokens, cache = generate(model, prompts, step)
            assert tokens == ref_tokens
            assert_bitwise(ref_logits, logits, f"step {step}, batched: logits")
            assert_bitwise(ref_cache, cache, f"step {step}, batched: cache")
        model.bank.close()


def test_one_read_per_expert_per_prompt_batch(checkpoint: tuple[Path, Any, Any]) -> None:
    """A batch of two prompts of 5 steps, with a pool that holds one layer's experts: each
    routed expert of each layer is read at most once for the batch's prefill; step by step
    (``layer_major=False``, the old way) reads them again each step."""
    full, manifest, _ = checkpoint
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 384, size=5 * 16 + 1).tolist() for _ in range(2)]
    calls: dict[bool, list[tuple[int, Any]]] = {}
    read_bytes: dict[bool, int] = {}
    for layer_major in (True, False):
        with LocalSource(manifest, full, verify=False) as source:
            model, _ = load(full, source, ram_bytes=1, prefetch=False, speculate=False,
                            layer_major=layer_major)
            bank = model.bank
            bank.resize(bank.experts_per_layer * bank.slot_nbytes)
            # max_tokens=1: the prefill, then the last prompt tokens' step and the one the
            # generator computes ahead (each reads its rows' experts in every layer).
            batch_generate(model, Tokens(), prompts, max_tokens=1, prefill_step_size=16)
            calls[layer_major] = list(source.calls)
            read_bytes[layer_major] = int(bank.stats.source_bytes)
            model.bank.close()
    # Layer by layer, the prefill is the reads before the first that goes back to an earlier
    # layer (the decode steps run every layer in order after it).
    layers = [layer for layer, _ in calls[True]]
    end = next(i for i in range(1, len(layers)) if layers[i] < layers[i - 1])
    prefill = Counter((layer, int(e)) for layer, ids in calls[True][:end] for e in ids)
    assert prefill and max(prefill.values()) == 1, [k for k, n in prefill.items() if n > 1]
    moe = sorted(set(layers))
    assert {layer for layer, _ in prefill} == set(moe[:-1])  # the last's output feeds nothing
    assert layers[end:] == moe * 2, layers  # the two decode steps
    # Step by step reads every layer again each step: 5 prefill steps and the 2 decode steps.
    assert [layer for layer, _ in calls[False]] == moe * 7
    assert read_bytes[False] > 3 * read_bytes[True], read_bytes


def test_a_pool_smaller_than_a_layer_on_the_batched_path(checkpoint: tuple[Path, Any, Any]) -> None:
    """The run-ahead pass with a pool of a third of a layer takes each layer's steps together
    (``pool.chunks``): two prompts of 5 steps batched, bitwise mlx-lm's, and fewer reads than
    the same pass with each step's call in turn."""
    full, manifest, reference = checkpoint
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 384, size=5 * 16 + 1).tolist() for _ in range(2)]
    ref_logits, ref_tokens, ref_cache = generate(reference, prompts, 16)
    reads = {}
    for together in (True, False):
        with LocalSource(manifest, full, verify=False) as source:
            model, _ = load(full, source, ram_bytes=1, prefetch=False, speculate=False)
            _grouped(model, together)
            logits, tokens, cache = generate(model, prompts, 16)
            assert tokens == ref_tokens
            assert_bitwise(ref_logits, logits, f"together={together}: logits")
            assert_bitwise(ref_cache, cache, f"together={together}: cache")
            assert model.ahead.passes >= 1
            reads[together] = sum(len(ids) for _, ids in source.calls)
            model.bank.close()
    assert reads[True] < reads[False], reads


def test_the_pass_copy_of_the_caches_goes_when_the_pass_ends(
        checkpoint: tuple[Path, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass runs on a copy of the batch's caches, which holds the whole prompt's keys and
    values by its end: it is freed as the pass ends (with the collector off, as between its
    runs), not kept beside the real caches the replay fills."""
    import copy
    import gc
    import weakref

    from cachecd_engine import prefill_batch

    full, manifest, _ = checkpoint
    copies: list[Any] = []
    real = copy.deepcopy

    def recorded(x: Any, *a: Any) -> Any:
        out = real(x, *a)
        if isinstance(out, list) and out and prefill_batch.batch_caches(out):
            copies.extend(weakref.ref(c) for c in out)
        return out

    monkeypatch.setattr(prefill_batch.copy, "deepcopy", recorded)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 384, size=3 * 16 + 1).tolist() for _ in range(2)]
    with LocalSource(manifest, full, verify=False) as source:
        model, _ = load(full, source, ram_bytes=1, prefetch=False, speculate=False)
        gc.collect()
        gc.disable()
        try:
            batch_generate(model, Tokens(), prompts, max_tokens=1, prefill_step_size=16)
            assert model.ahead.passes >= 1 and copies
            alive = [r for r in copies if r() is not None]
        finally:
            gc.enable()
        model.bank.close()
    assert not alive, f"{len(alive)} of {len(copies)} copied caches outlived the pass"


def test_prompts_of_unequal_lengths_read_each_layer_once(checkpoint: tuple[Path, Any, Any]) -> None:
    """A 300- and a 157-token prompt batched: the steps both rows fill, and the padded step
    where the shorter ends, run in one pass (its ``prepare``/``finalize`` on the pass's copy),
    the longer's steps after it in a second: the batch reads at most 1.2x what the two prompts
    read one after the other (the padded step alone step by step made it about 1.5x), and
    every logit, token and cache is resident mlx-lm's ``batch_generate``'s."""
    full, manifest, reference = checkpoint
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 384, size=n).tolist() for n in (300, 157)]
    reads = []
    for batch in (prompts, prompts[:1], prompts[1:]):
        with LocalSource(manifest, full, verify=False) as source:
            model, _ = load(full, source, ram_bytes=1, prefetch=False, speculate=False)
            bank = model.bank
            bank.resize(bank.experts_per_layer * bank.slot_nbytes)
            logits, tokens, cache = generate(model, batch, 16)
            reads.append(sum(len(ids) for _, ids in source.calls))
            if batch is prompts:
                ref_logits, ref_tokens, ref_cache = generate(reference, batch, 16)
                assert tokens == ref_tokens
                assert_bitwise(ref_logits, logits, "unequal lengths: logits")
                assert_bitwise(ref_cache, cache, "unequal lengths: cache")
                assert model.ahead.passes == 2 and model.ahead.padded == 1
            model.bank.close()
    together, apart = reads[0], reads[1] + reads[2]
    assert together <= 1.2 * apart, (together, apart)


def test_a_batch_dropped_mid_prefill_leaves_nothing(checkpoint: tuple[Path, Any, Any]) -> None:
    """A generator closed after its first prefill step (a server's batch cancelled, a caller
    that stops): the steps run ahead for it, and its caches, go with it, not at a later call."""
    import gc
    import weakref

    from mlx_lm.generate import BatchGenerator

    full, manifest, _ = checkpoint
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 384, size=5 * 16 + 1).tolist() for _ in range(2)]
    with LocalSource(manifest, full, verify=False) as source:
        model, _ = load(full, source, ram_bytes=1 << 30, prefetch=False)
        gen = BatchGenerator(model, max_tokens=1, prefill_step_size=16)
        gen.insert(prompts)
        gen.next()  # the first step: the prompts' steps run ahead, the first replayed
        assert model.ahead.current is not None and model.ahead.passes == 1
        caches = [weakref.ref(c) for c in gen._prompt_batch.prompt_cache]
        gen.close()
        del gen
        gc.collect()
        assert model.ahead.current is None
        assert all(r() is None for r in caches), "the engine keeps a dropped batch's caches"
        model.bank.close()
