"""The plan's model, checked where the answer is known by hand: hit rates of replays whose
outcome is forced, flat routing's C/N, a token's time from its parts, and the pool the plan
recommends being the engine's own default for the same figures."""

from __future__ import annotations

import numpy as np
import pytest

from cachecd.manifest.manifest import Manifest, shipped_manifest
from cachecd.plan.routing import Workload, flat
from cachecd.plan.simulate import pool_slots, replay
from cachecd.plan.speed import Machine, page_share, token_s

GB = 10**9


@pytest.fixture(scope="module")
def tiny() -> Manifest:
    path = shipped_manifest("cachecd/tiny-k3")
    assert path is not None
    return Manifest.load(path)


def _same_token(m: Manifest, tokens: int, experts: list[int]) -> Workload:
    calls = [(layer, experts, True) for _ in range(tokens) for layer in m.moe_layers]
    return Workload(calls, tokens, "trace", len(experts))


def test_a_token_repeated_hits_the_pool_every_time_after_the_runs_first_read(
        tiny: Manifest) -> None:
    """A run starts with an empty pool: its first token reads its 20 experts (from the Hub:
    nothing fits a budget of 0), the next two find them in the pool."""
    work = _same_token(tiny, 3, [0, 1, 2, 3])
    c = replay(tiny, work, slots=len(tiny.moe_layers) * 4, budget=0)
    assert (c.asked, c.pool_hits, c.disk_hits, c.hub_bytes) == (60, 40, 0, 20 * 6528)
    disk = replay(tiny, work, slots=len(tiny.moe_layers) * 4, budget=tiny.expert_bytes_total)
    assert (disk.pool_hits, disk.disk_hits, disk.hub_bytes) == (40, 20, 0)  # the disk kept them


def test_a_budget_of_the_whole_model_serves_every_pool_miss_from_disk(tiny: Manifest) -> None:
    work = flat(tiny, 4, 10, seed=3)  # 10 tokens of flat routing, as a trace would give them
    work.source = "trace"
    c = replay(tiny, work, slots=8, budget=tiny.expert_bytes_total)
    assert c.asked == 200 and c.hub_bytes == 0 and c.disk_hit_rate == 1.0
    none = replay(tiny, work, slots=8, budget=0)  # nothing fits: every miss from the Hub
    assert none.disk_hits == 0 and none.pool_hits == c.pool_hits
    assert none.hub_bytes == (none.asked - none.pool_hits) * int(tiny.sizes[0])


@pytest.mark.parametrize("slots", [40, 80, 120])
def test_flat_routing_hits_in_proportion_to_the_share_held(tiny: Manifest, slots: int) -> None:
    c = replay(tiny, flat(tiny, 4, 200, seed=1), slots=slots, budget=0)
    # The pool a little less: a pool of a few tokens' worth gives its scratch slots to each
    # call's misses (40 slots, two tokens' worth: 0.21 of 0.25, as the engine's bank does).
    share = slots / tiny.n_experts
    assert share - 0.05 <= c.pool_hit_rate <= share + 0.01
    half = replay(tiny, flat(tiny, 4, 200, seed=1), slots=8,
                  budget=tiny.expert_bytes_total // 2)
    assert half.disk_hit_rate == pytest.approx(0.5, abs=0.05)


def test_pool_slots_follow_the_loader(tiny: Manifest) -> None:
    assert pool_slots(0, 100, top_k=4, experts=160) == 8  # two decode calls at least
    assert pool_slots(10**12, 100, top_k=4, experts=160) == 160  # no more than the experts
    assert pool_slots(5000, 100, top_k=4, experts=160) == 50


def _machine(**kw: float | None) -> Machine:
    base = dict(total=64 << 30, available=60 << 30, gpu=None, cold_rate=2 * GB, page_rate=8 * GB,
                hub_rate=0.5 * GB, resolve_s=0.1)
    return Machine(**{**base, **kw})  # type: ignore[arg-type]


def test_a_token_is_compute_plus_each_source_bytes_over_its_rate() -> None:
    m = _machine()
    assert token_s(0.1, 4 * GB, 1 * GB, m, 0.0) == pytest.approx(0.1 + 2.0 + 2.0)
    assert token_s(0.1, 4 * GB, 0, m, 1.0) == pytest.approx(0.1 + 0.5)
    assert token_s(0.1, 4 * GB, 0, m, 0.25) == pytest.approx(0.1 + 0.125 + 1.5)
    assert token_s(0.1, 0, 1, _machine(hub_rate=None), 1.0) is None  # the Hub not measured
    assert page_share(m, pool_bytes=40 << 30, disk_cached=10 << 30) == 1.0
    assert page_share(m, pool_bytes=40 << 30, disk_cached=40 << 30) == 0.5


def test_the_recommended_pool_is_the_engines_default(monkeypatch: pytest.MonkeyPatch,
                                                     tiny: Manifest) -> None:
    from cachecd.plan.plan import recommended_pool
    from cachecd_engine.pool import memory

    m = _machine(total=128 << 30, available=100 << 30)
    monkeypatch.setattr(memory, "physical_memory", lambda: 128 << 30)
    monkeypatch.setattr(memory, "available_memory",
                        lambda: (100 << 30) - tiny.resident_bytes_total)  # once loaded
    monkeypatch.setattr(memory, "gpu_memory", lambda: None)
    assert recommended_pool(m, tiny) == memory.default_pool_bytes() == 64 << 30  # the cap
    m = _machine(total=128 << 30, available=50 << 30)
    monkeypatch.setattr(memory, "available_memory",
                        lambda: (50 << 30) - tiny.resident_bytes_total)
    assert recommended_pool(m, tiny) == memory.default_pool_bytes()
    assert recommended_pool(m, tiny) == (50 << 30) - tiny.resident_bytes_total - (32 << 30)


def test_the_engine_probe_measures_the_streamed_layer(tiny: Manifest) -> None:
    from cachecd.plan.probe import engine_costs, expert_dims

    assert expert_dims(tiny) == (64, 64)
    costs = engine_costs(tiny, 4, reps=3)
    assert 0 < costs.compute_s < 0.1 and costs.call_s >= 0 and costs.miss_s >= 0
    assert costs.request_experts == 0 and costs.miss_call_s(10**9) >= 0  # a local file


def test_cold_reads_go_at_the_queue_depth_a_calls_misses_reach() -> None:
    from cachecd.plan.speed import Calls, queue_depth

    assert queue_depth(4 * 6528) == 1  # small experts: one job, read one after another
    assert queue_depth(10 * 17_547_264) == 4  # K3's: 4 MiB windows over the client's 4 readers
    m = _machine(cold_by_depth=((1, 0.1 * GB), (4, 2 * GB), (32, 3 * GB)))
    assert m.cold_at(1) == 0.1 * GB and m.cold_at(4) == 2 * GB and m.cold_at(8) == 2 * GB
    small = Calls(calls=5, miss_calls=5)
    assert token_s(0.0, 0.5 * GB, 0, m, 0.0, small) == pytest.approx(0.25)  # 0.1 GB a call: QD 4
    tiny = Calls(calls=5, miss_calls=5)
    assert token_s(0.0, 5 * 26_112, 0, m, 0.0, tiny) == pytest.approx(5 * 26_112 / (0.1 * GB))


def test_the_replay_moves_the_pool_as_the_engines_bank_does(tiny: Manifest, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Call for call, the replay's pool hits are the engine's: the same routing through a real
    ``ExpertBank`` (its pool smaller than a token's experts, prefill calls over more experts
    than the pool holds, so they go in groups) and through ``simulate.through_pool``."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchGLU

    from cachecd.plan.probe import _expert_bytes, _FileSource, expert_dims
    from cachecd.plan.simulate import slot_bytes, through_pool
    from cachecd_engine.formats import quant_spec
    from cachecd_engine.pool.bank import ExpertBank
    from cachecd_engine.pool.slots import SlotTable
    from cachecd_engine.streamed_moe import StreamedSwitchGLU, as_template

    rng = np.random.default_rng(11)
    e, hidden = tiny.experts_per_layer, expert_dims(tiny)[0]
    skew = 1 / np.arange(1, e + 1)  # a few experts routed often: some stay in the pool
    steps = [4, 4, 4] + [1] * 40  # tokens: prefills (16 experts, more than the pool), decodes
    (tmp_path / "expert").write_bytes(_expert_bytes(tiny))
    spec = quant_spec(tiny.quant_format)
    with _FileSource(tiny, str(tmp_path / "expert")) as source:
        bank = ExpertBank(source, spec, 10 * slot_bytes(tiny), experts_per_layer=e)
        layers = {}
        for layer in tiny.moe_layers:
            glu = as_template(SwitchGLU(hidden, expert_dims(tiny)[1], e), spec)
            layers[layer] = StreamedSwitchGLU(layer, glu, bank)
        table, engine, replayed = None, [], []
        for step in steps:
            for layer in tiny.moe_layers:
                rows = [rng.choice(e, 4, replace=False, p=skew / skew.sum()).tolist()
                        for _ in range(step)]
                before = bank.stats.ram_hits
                x = mx.zeros((1, len(rows), hidden))
                mx.eval(layers[layer](x, mx.array(rows, dtype=mx.uint32)[None]))
                engine.append(bank.stats.ram_hits - before)
                table = table or SlotTable(bank.capacity)
                replayed.append(len(through_pool(table, layer, sum(rows, []))[1]))
        bank.close()
    assert bank.capacity == 10 and bank.stats.groups > bank.stats.layer_calls  # some in groups
    assert sum(engine) > 20
    assert replayed == engine


def test_a_miss_call_read_through_the_daemon_holds_its_round_trip() -> None:
    """Measured through the daemon, a miss call's cost holds its round trip (the doctor's,
    asked back to back, is not added again) and its experts' daemon costs; more or fewer
    experts than it asked change it by the daemon's cost per expert. Its bytes are counted apart,
    at the page cache's rate."""
    from cachecd.plan.probe import EngineCosts
    from cachecd.plan.speed import Calls

    m = _machine(request_s=0.001, per_expert_s=0.0001)
    local = Calls(calls=5, miss_calls=5, miss_call_s=0.0005, misses=20)
    assert local.seconds(m) == pytest.approx(5 * 0.0005 + 5 * 0.001 + 15 * 0.0001)
    daemon = Calls(calls=5, miss_calls=5, miss_call_s=0.0005, misses=18, request_experts=4)
    assert daemon.seconds(m) == pytest.approx(5 * 0.0005 - 2 * 0.0001)
    costs = EngineCosts(0.001, 0.0002, 0.0007, miss_bytes=100_000, request_experts=4)
    assert costs.miss_call_s(1 * GB) == pytest.approx(0.0006)
    assert costs.miss_call_s(0.01 * GB) == 0.0  # never below nothing


def test_cold_reads_go_at_the_rate_the_engine_probe_read_them_where_it_did() -> None:
    """A cold call's extra time over the same call from the page cache, with the bytes' time at
    the page cache's rate, gives the rate the engine's cold misses go at; a token's cold bytes
    go at it instead of the doctor's (block reads back to back, faster for small experts)."""
    from cachecd.plan.probe import EngineCosts
    from cachecd.plan.speed import Calls

    costs = EngineCosts(0.0, 0.0, 0.0004, miss_bytes=4 * 6528, request_experts=4,
                        cold_miss_s=0.0004 + 4 * 90e-6)
    rate = costs.cold_rate(2 * GB)
    assert rate == pytest.approx(4 * 6528 / (4 * 6528 / (2 * GB) + 4 * 90e-6))
    m = _machine(cold_by_depth=((1, 0.15 * GB),))
    calls = Calls(calls=5, miss_calls=5, misses=20, cold_rate=rate)
    assert token_s(0.0, 20 * 6528, 0, m, 0.0, calls) == pytest.approx(20 * 6528 / rate)
    doctor = Calls(calls=5, miss_calls=5, misses=20)
    assert token_s(0.0, 20 * 6528, 0, m, 0.0, doctor) == pytest.approx(20 * 6528 / (0.15 * GB))
