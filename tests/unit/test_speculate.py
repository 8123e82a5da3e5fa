"""Decode steps on the device map: kept when every routed expert is in the pool (no per-layer
read-back), thrown away and run again the per-layer way when one is not; logits bitwise the
resident model's either way.

The small-pool test is the sharp one: most speculative steps there route to an expert no slot
holds, so their rows were computed from slot 0's bytes; keeping any of them would show.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from cachecd_engine.formats import QUANT_SPECS
from cachecd_engine.loader import streamed_classes
from cachecd_engine.pool.bank import EngineStats, ExpertBank
from cachecd_engine.pool.speculate import DeviceMap, Speculator, restorable
from cachecd_engine.streamed_moe import install_streamed_banks
from tests.exactness import assert_bitwise, run_logits
from tests.inprocess_model import DictSource, build_resident, serialize_experts

FMT = "mxfp4-pack-quantized"
PROMPT = [(7 * i + 3) % 500 for i in range(20)]
STEPS = 20


@pytest.fixture(scope="module")
def reference() -> tuple[list, list[int]]:  # type: ignore[type-arg]
    return run_logits(build_resident(FMT), PROMPT, steps=STEPS)


def _speculating(slots: int) -> tuple[object, ExpertBank, DictSource]:
    model = build_resident(FMT)
    source = DictSource(serialize_experts(model, FMT))
    bank = ExpertBank(source, QUANT_SPECS[FMT], slots * source.entry(1, 0).nbytes, EngineStats())
    layers = install_streamed_banks(model, bank)
    bank.speculator = Speculator(bank, layers)
    # The loader's model class: its __call__ runs each step through the speculator.
    cls, _ = streamed_classes(bank)({"model_type": "kimi_k3"})
    model.__class__ = type("Spec", (cls,), {"__init__": object.__init__})
    return model, bank, source


def test_a_warm_pool_keeps_every_decode_step(reference) -> None:  # type: ignore[no-untyped-def]
    ref, toks = reference
    model, bank, source = _speculating(slots=1000)
    run_logits(model, PROMPT, toks, steps=STEPS)  # cold: fills the pool
    spec = bank.speculator
    spec.kept = spec.missed = 0
    bank.stats.reset()
    asked = len(source.calls)
    got, _ = run_logits(model, PROMPT, toks, steps=STEPS)
    assert_bitwise(ref, got)
    assert (spec.kept, spec.missed) == (STEPS, 0)  # the prefill (20 tokens) is not speculated
    s = bank.stats
    assert len(source.calls) == asked and s.ram_hits == s.experts_routed and s.copied_bytes == 0
    assert s.layer_calls == 5 * (STEPS + 1)  # every layer call counted once


def test_steps_that_miss_are_thrown_away_without_a_trace(reference) -> None:  # type: ignore[no-untyped-def]
    ref, toks = reference
    model, bank, _ = _speculating(slots=8)  # far fewer than the tokens route to
    got, _ = run_logits(model, PROMPT, toks, steps=STEPS)
    assert_bitwise(ref, got)
    assert bank.speculator.missed > 0
    assert bank.stats.layer_calls == 5 * (STEPS + 1)  # a thrown-away step counts no call


def test_a_call_with_every_expert_held_leaves_the_device_map_as_built() -> None:
    model = build_resident(FMT)
    source = DictSource(serialize_experts(model, FMT))
    bank = ExpertBank(source, QUANT_SPECS[FMT], 16 * source.entry(1, 0).nbytes, EngineStats(),
                      experts_per_layer=32)
    device_map = DeviceMap(bank, [1])
    bank.acquire(1, [0, 1, 2])
    built = device_map.array()
    bank.acquire(1, [0, 1, 2])  # every expert held: nothing moved or filled, nothing to rebuild
    assert device_map.array() is built and bank.stats.ram_hits == 3
    bank.acquire(1, [3])
    assert device_map.array() is not built


def test_the_device_map_follows_the_table_through_every_change() -> None:
    """The map is made again from a host copy in which only the slots that changed are written:
    through claims, reads landing, forgotten reads, swaps and resizes of a small pool (two
    layers mapped, one not), it equals the map built from the whole table each time."""
    model = build_resident(FMT)
    source = DictSource(serialize_experts(model, FMT))
    bank = ExpertBank(source, QUANT_SPECS[FMT], 12 * source.entry(1, 0).nbytes, EngineStats(),
                      experts_per_layer=32)
    bank.prepare(1)
    table = bank.table
    assert table is not None
    rows = {1: 0, 3: 1}
    device_map = DeviceMap(bank, list(rows))
    rng = np.random.default_rng(0)
    for step in range(400):
        op = rng.random()
        if op < 0.5:
            layer, ids = int(rng.choice([1, 3, 5])), rng.choice(32, 3, replace=False).tolist()
            held = table.use(layer, ids)  # as a call does: then the misses get slots
            claim = table.claim(layer, ids, keep=held.values())
            landed = [s for s in claim.slots.values() if rng.random() < 0.7]
            table.filled(landed)  # the others stay filling for now
        elif op < 0.7:
            table.filled(table.unfilled())
        elif op < 0.8:
            table.forget([s for s in table.unfilled() if rng.random() < 0.5])
        elif op < 0.95:
            ready = [s for s in range(table.capacity) if not table.filling(s)]
            a, b = rng.choice(ready, 2, replace=False).tolist()
            table.swap([(a, b)])
        else:
            table.filled(table.unfilled())
            table.resize(int(rng.integers(6, 14)))
        if step % 3 == 0:
            want = np.zeros((2, 32), np.uint32)
            for (layer, e), slot in table.items():
                if layer in rows and not table.filling(slot):
                    want[rows[layer], e] = slot
            assert np.array_equal(np.array(device_map.array()), want), step


def test_only_restorable_caches_are_speculated() -> None:
    one = mx.array([[1]])
    assert restorable(one, [KVCache()])
    assert not restorable(mx.array([[1, 2]]), [KVCache()])  # a prefill
    assert not restorable(mx.array([[1], [2]]), [KVCache()])  # a batch
    assert not restorable(one, [QuantizedKVCache()])  # --kv-bits
    assert not restorable(one, None)
