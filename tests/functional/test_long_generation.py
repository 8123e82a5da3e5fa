"""A long generation through ``mlx_lm.stream_generate``: every step's logprobs bitwise the
resident model's, with a pool of slots far smaller than what the tokens route to, read-ahead
and speculative decode steps on, greedy and with seeded sampling at temperature 1.

Over many steps the pool turns over again and again: slots are refilled while mlx-lm keeps the
next step queued, read-ahead claims free slots beside queued calls, speculative steps are kept
or thrown away. Any slot refilled under a queued reader, any step kept that should not have
been, would show as a logprob that differs. ``CACHECD_LONG_TOKENS`` sets the length (small in
CI; 1,000+ on a GPU, where the kernels are others and the timing between host and device is).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model

from cachecd.testbed.tiny_model import write_tiny_model
from cachecd_engine.loader import load
from cachecd_engine.local_source import LocalSource, manifest_from_dir

TOKENS = int(os.environ.get("CACHECD_LONG_TOKENS", "160"))
PROMPT = "Every expert streams; the model decides every token, and no logit moves."
EXPERTS, TOP_K, LAYERS = 32, 4, 6  # 5 MoE layers x 32 experts; a decode step routes 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    full = write_tiny_model(tmp_path_factory.mktemp("long") / "full", seed=5, experts=EXPERTS,
                            top_k=TOP_K, layers=LAYERS)
    return full, manifest_from_dir(full, repo="cachecd/tiny-long")


def _run(model, tokenizer, temp: float) -> tuple[list[int], list[np.ndarray]]:  # type: ignore[no-untyped-def]
    mx.random.seed(1234)
    toks, logprobs = [], []
    for r in stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS,
                             sampler=make_sampler(temp=temp)):
        toks.append(r.token)
        logprobs.append(np.array(r.logprobs.astype(mx.float32)))
    return toks, logprobs


# 12 slots: no step's 20 experts ever all fit, every speculative step misses. 150 of the 160
# experts: some steps find all theirs in the pool and are kept, others miss and refill slots.
POOLS = {"tiny": 3 * TOP_K, "most": 150}


@pytest.mark.parametrize("temp", [0.0, 1.0])
@pytest.mark.parametrize("pool", list(POOLS))
def test_every_step_bitwise_with_a_pool_smaller_than_the_working_set(  # type: ignore[no-untyped-def]
        checkpoint, pool: str, temp: float) -> None:
    full, manifest = checkpoint
    reference, _ = load_model(full)
    one = manifest.expert(manifest.moe_layers[0], 0).nbytes
    with LocalSource(manifest, full) as source:
        model, tokenizer = load(full, source, ram_bytes=POOLS[pool] * one, prefetch=True,
                                speculate=True)
        tokenizer.eos_token_ids = set()  # random weights: never stop early
        want_toks, want = _run(reference, tokenizer, temp)
        got_toks, got = _run(model, tokenizer, temp)
        bank = model.bank
    assert len(want_toks) == TOKENS and got_toks == want_toks
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (
            f"step {step}: max |diff| = {float(np.max(np.abs(a - b)))}")
    # The pool was far smaller than the working set, and every mechanism was exercised.
    assert bank.capacity == POOLS[pool] and bank.table.counters.evicted > 0
    assert bank.stats.staged > 0 and bank.speculator.missed > 0
    assert (bank.speculator.kept > 0) == (pool == "most")
    print(f"steps={TOKENS} pool={pool} temp={temp} kept={bank.speculator.kept} "
          f"missed={bank.speculator.missed} staged={bank.stats.staged}")
