"""The first token of a prompt (``cachecd.plan.prompt``), checked where the answer is known by
hand: flat routing's distinct experts against a draw of them, a pool of one layer's routed
experts reading each once whatever the step, a smaller pool reading again per step as
docs/engine.md says, and the time from its parts."""

from __future__ import annotations

import numpy as np
import pytest

from cachecd.manifest.manifest import Manifest, shipped_manifest
from cachecd.plan.prompt import distinct, expert_bytes, project, prompt_reads, steps_of
from cachecd.plan.speed import Calls, Machine

GB = 10**9


@pytest.fixture(scope="module")
def tiny() -> Manifest:
    path = shipped_manifest("cachecd/tiny-k3")
    assert path is not None
    return Manifest.load(path)


def test_distinct_experts_are_those_flat_routing_draws() -> None:
    rng = np.random.default_rng(0)
    for experts, k, tokens in ((32, 4, 5), (32, 4, 40), (896, 16, 64), (896, 16, 2048)):
        seen = [len({int(e) for _ in range(tokens) for e in rng.choice(experts, k, replace=False)})
                for _ in range(20)]
        assert distinct(experts, k, tokens) == pytest.approx(np.mean(seen), rel=0.03)
    assert distinct(896, 16, 2048) > 895  # a K3 step of 2,048 tokens: nearly every expert


def test_steps_are_mlx_lms_the_last_token_alone() -> None:
    assert steps_of(200, 32) == [32] * 6 + [7, 1]
    assert steps_of(1, 32) == [1] and steps_of(33, 32) == [32, 1]


def test_a_pool_of_a_layer_reads_each_routed_expert_once_whatever_the_step(tiny: Manifest) -> None:
    one = prompt_reads(tiny, 4, 200, 2048, slots=160)
    many = prompt_reads(tiny, 4, 200, 16, slots=160)
    assert one.fits and many.fits and one.reads == pytest.approx(many.reads)
    assert many.reads == pytest.approx(many.unique)
    # Four MoE layers route over the whole prompt; the last one for its last token only.
    assert many.per_layer[:-1] == [pytest.approx(distinct(32, 4, 200))] * 4
    assert many.per_layer[-1] == pytest.approx(4.0)


def test_a_smaller_pool_reads_again_each_step(tiny: Manifest) -> None:
    reads = prompt_reads(tiny, 4, 200, 16, slots=10)
    e = [distinct(32, 4, r) for r in steps_of(200, 16)]
    assert not reads.fits
    assert reads.per_layer[0] == pytest.approx(sum(e) - (len(e) - 1) * 10)
    # Longer prompts and smaller pools read more; a projection ignoring either fails here.
    assert prompt_reads(tiny, 4, 400, 16, slots=10).reads > reads.reads
    assert prompt_reads(tiny, 4, 200, 16, slots=8).reads > reads.reads
    assert prompt_reads(tiny, 4, 20, 16, slots=10).reads < reads.reads


def test_the_first_token_is_compute_plus_the_reads_over_their_rates(tiny: Manifest) -> None:
    m = Machine(total=64 << 30, available=60 << 30, gpu=None, cold_rate=2 * GB,
                page_rate=8 * GB, hub_rate=0.5 * GB, resolve_s=0.1)
    reads = prompt_reads(tiny, 4, 200, 16, slots=10)
    calls = Calls(call_s=0.001, miss_call_s=0.002)
    got = project(tiny, m, reads, 0.5, calls, pool_bytes=10 << 10, tokens=200)
    b = expert_bytes(tiny)
    # A layer's steps: 12 of 16 tokens (28.2 experts: 6 groups of half the pool's 10 slots),
    # one of 7 (17.5: 4 groups), the last token's (4: one call); the last layer: that one only.
    # Every call reads; then the next token's forward, which mlx-lm runs before it yields the
    # first: a call a layer, 4 experts each read again.
    assert reads.calls == reads.miss_calls == 4 * (12 * 6 + 4 + 1) + 1 + 5
    assert reads.next_reads == 5 * 4
    base = 0.5 + reads.calls * 0.001 + reads.miss_calls * 0.002
    t = got["first_token_s"]
    assert t["warm"] == pytest.approx(base + reads.reads * b / (8 * GB))  # all in the page cache
    left = reads.reads - 10
    assert t["pool"] == pytest.approx(base + left * b / (8 * GB)
                                      - reads.miss_calls * 0.002 * 10 / reads.reads)
    shards = -(-len(tiny.shards) // 8)
    assert t["cold"] == pytest.approx(base + shards * 0.1 + reads.unique * b / (0.5 * GB)
                                      + (reads.reads - reads.unique) * b / (8 * GB))
    assert got["note"] and "docs/engine.md" in got["note"]
    whole = prompt_reads(tiny, 4, 200, 16, slots=160)
    # A layer's first step reads; the next token's experts are all in the pool.
    assert whole.calls == 4 * 14 + 1 + 5 and whole.miss_calls == 5 and whole.next_reads == 0
    fits = project(tiny, m, whole, 0.5, calls, 1 << 30, 200)
    assert fits["note"] is None
    assert fits["first_token_s"]["pool"] == pytest.approx(0.5 + whole.calls * 0.001)
