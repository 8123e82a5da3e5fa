"""Concurrent requests share the experts they read: a batched decode step (mlx-lm's
``BatchGenerator`` runs every request in flight through one forward pass, B rows) reads each
distinct expert of a layer once for the whole batch, not once per row that routes to it.

The streamed model is ``cachecd_engine.load``'s over a tiny fp32 K3 checkpoint; its reads are
counted where they happen (``LocalSource.calls``: each (layer, experts) read), and each layer
call's routing is seen as the bank gets it (all the batch's rows at once).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cachecd.testbed.tiny_model import write_tiny_model
from cachecd_engine.loader import load
from cachecd_engine.local_source import LocalSource, manifest_from_dir

BATCH, PROMPT = 4, 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    full = write_tiny_model(tmp_path_factory.mktemp("batched") / "full", seed=0, fmt="fp32")
    return full, manifest_from_dir(full, repo="cachecd/batched-reads")


@pytest.mark.parametrize("slots", ["two", "one layer"])
def test_a_batched_decode_step_reads_each_distinct_expert_once(
        checkpoint: tuple[Path, Any], slots: str) -> None:
    full, manifest = checkpoint
    with LocalSource(manifest, full, verify=False) as source:
        model, _ = load(full, source, ram_bytes=1, prefetch=False, speculate=False)
        bank = model.bank
        if slots == "one layer":
            bank.resize(bank.experts_per_layer * bank.slot_nbytes)
        prompts = np.random.default_rng(3).integers(0, 384, size=(BATCH, PROMPT))
        cache = make_prompt_cache(model)
        logits = model(mx.array(prompts), cache=cache)  # the batch's prefill
        step = mx.argmax(logits[:, -1:, :], axis=-1)  # [B, 1]: one token a row
        bank.settle()
        seen: list[tuple[int, np.ndarray, set[int]]] = []  # layer, routing, held at the call
        run = bank.run

        def watched(layer: int, glu: Any, x: mx.array, routed: np.ndarray) -> mx.array:
            held = {int(e) for e in np.unique(routed) if bank.holds(layer, int(e))}
            seen.append((layer, routed.copy(), held))
            return run(layer, glu, x, routed)

        bank.run = watched  # type: ignore[method-assign]
        before = len(source.calls)
        mx.eval(model(step, cache=cache))  # one batched decode step
        bank.settle()
        reads = Counter((layer, e) for layer, ids in source.calls[before:] for e in ids)
        bank.close()
    assert seen and all(r.shape[0] == BATCH for _, r, _ in seen)  # one call a layer, all rows
    union = {(layer, int(e)) for layer, r, held in seen for e in np.unique(r) if int(e) not in held}
    assert max(reads.values()) == 1, [k for k, n in reads.items() if n > 1]
    assert set(reads) == union
    # The rows share experts: read row by row, the same step would read more.
    per_row = sum(len({int(e) for e in row.ravel()} - held) for _, r, held in seen for row in r)
    assert per_row > len(union), (per_row, len(union))
