"""Streamed vs resident on the real tiny K3 checkpoint: every logit bitwise equal.

The checkpoint comes from ``cachecd.testbed.tiny_model`` (mxfp4 experts with bf16 activations, and fp32)
with small shards so some experts are split across two files. The reference is
``mlx_lm.utils.load_model`` on the full checkpoint; the streamed model loads a directory with the
resident weights only and reads experts from the checkpoint through its manifest's ranges.
"""

from __future__ import annotations

import pytest
from mlx.utils import tree_flatten
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model

from cachecd.testbed.tiny_model import write_tiny_model
from cachecd_engine.loader import is_expert_weight, load
from cachecd_engine.local_source import LocalSource, manifest_from_dir
from cachecd_engine.streamed_moe import StreamedSwitchGLU
from tests.exactness import DECODE_STEPS, assert_bitwise, make_resident_dir, run_logits

PROMPT_TEXT = "The quick brown fox jumps over the lazy dog, then streams every expert."
SHARD_BYTES = 96 * 1024  # small shards: several experts straddle two files


@pytest.fixture(scope="module", params=["mxfp4", "fp32"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(f"tiny-{request.param}")
    full = write_tiny_model(root / "full", seed=0, fmt=request.param, shard_bytes=SHARD_BYTES)
    manifest = manifest_from_dir(full, repo="cachecd/tiny-k3")
    assert manifest.split_experts > 0, "the test needs experts split across shards"
    resident_dir = make_resident_dir(full, manifest, root / "resident")
    reference, _ = load_model(full)
    return request.param, full, manifest, resident_dir, reference


def _prompt(tokenizer) -> list[int]:
    tokens = tokenizer.encode(PROMPT_TEXT)
    assert len(tokens) >= 16  # x top-4 >= 64 rows: mlx-lm's sorted gather path
    return tokens


def test_bitwise_cold_and_warm_from_resident_dir(checkpoint) -> None:
    _, full, manifest, resident_dir, reference = checkpoint
    with LocalSource(manifest, full) as source:
        model, tokenizer = load(resident_dir, source, ram_bytes=1 << 30)
        prompt = _prompt(tokenizer)
        assert not source.calls, "loading must not ask for any expert"
        ref, toks = run_logits(reference, prompt)
        cold, _ = run_logits(model, prompt, toks)
        assert_bitwise(ref, cold)
        stats = model.bank.stats
        # Every expert read from the source (on demand or ahead) stays in a slot of the pool.
        one = manifest.expert(1, 0).nbytes
        assert stats.source_hits > 0 and stats.source_bytes == len(model.bank.table) * one
        stats.reset()
        warm, _ = run_logits(model, prompt, toks)
        assert_bitwise(ref, warm)
        assert stats.source_hits == 0 and stats.ram_hits == stats.experts_routed > 0
    split = {(e.layer, e.expert) for e in manifest.experts() if len({r.file for r in e.ranges}) > 1}
    fetched = {(layer, e) for layer, ids in source.calls for e in ids}
    assert split & fetched, "some routed expert must be one split across shards"


def test_bitwise_with_the_smallest_pool_from_full_dir(checkpoint) -> None:
    """Loading from the full checkpoint dir ignores its expert tensors; a pool of two slots,
    so every call reads its experts, in groups; read-ahead is on (hints in the prefill, reads
    into free slots while decoding)."""
    _, full, manifest, _, reference = checkpoint
    with LocalSource(manifest, full) as source:
        model, tokenizer = load(full, source, ram_bytes=0, prefetch=True)
        prompt = _prompt(tokenizer)
        ref, toks = run_logits(reference, prompt)
        got, _ = run_logits(model, prompt, toks)
        assert_bitwise(ref, got)
        stats = model.bank.stats
        assert stats.layer_calls == 5 * (DECODE_STEPS + 1) < stats.groups
        # Every routed expert was read from the checkpoint: ahead of its call, or in it.
        assert stats.source_hits + stats.staged_hits + stats.ram_hits == stats.experts_routed
        assert stats.ram_hits < stats.experts_routed / 10
        asked = sum(len(ids) for _, ids in source.calls)
        assert asked == stats.source_hits + stats.staged
        # The prefill's hints went out for layers 2.. (and, being hints, changed no logit).
        assert len(source.prefetched) == model.prefetcher.hints == 4
        assert {layer for layer, _ in source.prefetched} == set(manifest.moe_layers[1:])


def test_loaded_model_has_no_expert_parameters(checkpoint) -> None:
    _, full, manifest, resident_dir, _ = checkpoint
    with LocalSource(manifest, full) as source:
        model, _ = load(resident_dir, source, ram_bytes=0)
    names = [k for k, _ in tree_flatten(model.parameters())]
    assert names and not any(is_expert_weight(k) for k in names)
    banks = [layer.mlp.switch_mlp for layer in model.layers if hasattr(layer.mlp, "switch_mlp")]
    assert [b.layer for b in banks] == list(manifest.moe_layers)
    assert all(isinstance(b, StreamedSwitchGLU) for b in banks)
    assert set(t.name for t in manifest.resident).isdisjoint(
        t.name for e in manifest.experts() for t in e.tensors
    )


def test_stream_generate_matches_resident_text(checkpoint) -> None:
    _, full, manifest, resident_dir, reference = checkpoint
    with LocalSource(manifest, full) as source:
        model, tokenizer = load(resident_dir, source, ram_bytes=1 << 30)
        greedy = make_sampler(temp=0.0)

        def tokens(m) -> list[int]:
            return [
                r.token
                for r in stream_generate(m, tokenizer, PROMPT_TEXT, max_tokens=24, sampler=greedy)
            ]

        assert tokens(model) == tokens(reference)
