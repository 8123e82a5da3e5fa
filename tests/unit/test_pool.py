"""The slot pool: its table (which expert in which slot, who may be evicted), its fences (no slot
is written while queued work reads it) and its resize (outputs unchanged).

The fence tests keep the first call's output queued on purpose (``mx.async_eval`` made a no-op,
so MLX computes it only when asked): if a slot it reads were refilled first, its output would
be computed from another expert's bytes and differ from the resident layer's, bitwise.
"""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np
import pytest

from cachecd_engine.formats import QUANT_SPECS
from cachecd_engine.pool.bank import EngineStats, ExpertBank
from cachecd_engine.pool.cuda_memory import Copier
from cachecd_engine.pool.slots import SlotTable
from cachecd_engine.streamed_moe import install_streamed_banks
from tests.exactness import assert_bitwise, run_logits
from tests.inprocess_model import DictSource, build_resident, serialize_experts

FMT = "mxfp4-pack-quantized"
PROMPT = [(7 * i + 3) % 500 for i in range(20)]


def test_table_takes_free_slots_then_the_policys_victims() -> None:
    t = SlotTable(3, policy="lru")
    got = t.claim(1, [5, 6, 7], use=True)
    assert got.slots == {5: 0, 6: 1, 7: 2} and not got.fences
    t.filled(got.slots.values())
    assert t.use(1, [5, 9]) == {5: 0}  # 5 is now the most recent; 9 is a miss
    again = t.claim(1, [8], use=True)  # evicts the least recent: 6
    assert again.slots == {8: 1} and (1, 6) not in t and (1, 5) in t
    assert (t.counters.hits, t.counters.misses, t.counters.evicted) == (1, 1, 1)


def test_table_never_takes_kept_filling_or_fenced_slots_unless_asked() -> None:
    t = SlotTable(4, policy="lru")
    t.filled(t.claim(1, [0, 1, 2, 3]).slots.values())
    t.claim(2, [9])  # slot 0 (expert 0, least recent) is now filling for (2, 9)
    marker = object()
    t.fence([1], marker)  # queued work reads slot 1
    assert t.claim(3, [1], keep={2}, take_fenced=False).slots == {1: 3}  # not 0, 1 or 2
    t.filled([0, 3])
    got = t.claim(3, [2], keep={0, 3})
    assert got.slots == {2: 1} and got.fences == [marker]  # fenced: its reader comes back
    assert t.claim(3, [3], keep={0, 1, 2, 3}).slots == {}  # nothing left to take


def test_table_forget_frees_a_slot_and_resize_keeps_the_policys_choice() -> None:
    t = SlotTable(4, policy="lru")
    t.filled(t.claim(1, [0, 1, 2, 3], use=True).slots.values())
    t.forget([t.slot((1, 1))])
    assert (1, 1) not in t and t.claim(1, [7]).slots == {7: 1}
    t.filled([1])
    t.use(1, [0])
    moves = t.resize(2)  # keeps the two most recent: 0 and 7
    assert t.capacity == 2 and {k for k, _ in t.items()} == {(1, 0), (1, 7)}
    assert sorted(moves.values()) == [0, 1] and sorted(moves) == [0, 1]
    t.resize(5)
    assert t.claim(2, [0, 1, 2]).slots == {0: 2, 1: 3, 2: 4}
    with pytest.raises(ValueError):
        SlotTable(0)


def _replay(table: SlotTable, steps: int, layers: int = 5, experts: int = 64, k: int = 16,
            seed: int = 0) -> float:
    """Hit rate over the last two thirds of a skewed routing replayed as the bank drives the
    table: every routed expert looked up, then the misses claimed (each needs a slot)."""
    rng = np.random.default_rng(seed)
    popularity = [rng.dirichlet(np.full(experts, 0.5)) for _ in range(layers)]
    hits = asked = 0
    for step in range(steps):
        for layer in range(layers):
            ids = rng.choice(experts, k, replace=False, p=popularity[layer]).tolist()
            held = table.use(layer, ids)
            if step >= steps // 3:
                hits, asked = hits + len(held), asked + len(ids)
            claim = table.claim(layer, [e for e in ids if e not in held], set(held.values()),
                                use=True)
            table.filled(claim.slots.values())
            assert len(table) <= table.capacity
    return hits / asked


@pytest.mark.parametrize("policy", ["lru", "wlfu"])
def test_a_pool_smaller_than_a_step_keeps_its_most_used_experts(policy: str) -> None:
    """57 slots, 80 experts a step: every miss needs a slot, and without admission by use
    counts each step's misses would push out everything the next step uses (hit rate 0.000
    with either policy alone). Admitted by count, the most used stay."""
    assert _replay(SlotTable(57, policy), steps=300) > 0.3
    assert _replay(SlotTable(200, policy), steps=300) > 0.85  # a bigger pool still holds


@pytest.fixture(scope="module")
def blobs() -> dict:  # type: ignore[type-arg]
    return serialize_experts(build_resident(FMT), FMT)


def _bank(blobs, slots: int) -> tuple[object, ExpertBank]:  # type: ignore[no-untyped-def]
    model = build_resident(FMT)
    source = DictSource(blobs)
    bank = ExpertBank(source, QUANT_SPECS[FMT], slots * source.entry(1, 0).nbytes, EngineStats())
    install_streamed_banks(model, bank)
    return model, bank


def _inputs(layer_experts: list[int]) -> tuple[mx.array, np.ndarray]:
    x = mx.random.normal((1, 1, 64), key=mx.random.key(len(layer_experts))).astype(mx.bfloat16)
    return x, np.array([[layer_experts]], dtype=np.uint32)


def _resident_outputs(calls: list[tuple[int, list[int]]]) -> list[np.ndarray]:
    model = build_resident(FMT)
    out = []
    for layer, experts in calls:
        x, routed = _inputs(experts)
        y = model.layers[layer].mlp.switch_mlp(x, mx.array(routed))
        out.append(np.array(y.astype(mx.float32)))
    return out


CALLS = [(1, [0, 1, 2, 3]), (2, [4, 5, 6, 7])]  # disjoint: the second needs the first's slots


def test_a_slot_is_not_refilled_while_a_queued_call_reads_it(blobs, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(mx, "async_eval", lambda *a: None)  # keep each call queued
    model, bank = _bank(blobs, slots=4)
    ys = []
    for layer, experts in CALLS:
        x, routed = _inputs(experts)
        ys.append(bank.run(layer, model.layers[layer].mlp.switch_mlp._glu, x, routed))
    assert bank.table is not None and {k for k, _ in bank.table.items()} == {(2, e) for e in CALLS[1][1]}
    got = [np.array(y.astype(mx.float32)) for y in ys]
    assert_bitwise(_resident_outputs(CALLS), got)


def test_expert_wait_counts_neither_queued_readers_nor_the_tables_work(blobs, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The second call needs the slots the queued first call reads: evaluating that call is
    earlier compute (``readers_s``), not a wait for expert bytes (``wait_s``). The filler's
    clock moves only while that evaluation runs (5 s by this clock), so each second is seen
    where it was counted."""
    from types import SimpleNamespace

    from cachecd_engine.pool import fill

    monkeypatch.setattr(mx, "async_eval", lambda *a: None)  # keep the first call queued
    model, bank = _bank(blobs, slots=4)
    (l1, e1), (l2, e2) = CALLS
    x, routed = _inputs(e1)
    bank.run(l1, model.layers[l1].mlp.switch_mlp._glu, x, routed)
    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(fill, "time", SimpleNamespace(perf_counter=lambda: clock.t))
    real_eval = mx.eval

    def evaluate(*arrays: object) -> None:
        real_eval(*arrays)
        clock.t += 5.0

    monkeypatch.setattr(mx, "eval", evaluate)
    bank.stats.reset()
    x, routed = _inputs(e2)
    bank.run(l2, model.layers[l2].mlp.switch_mlp._glu, x, routed)
    s = bank.stats
    assert (s.readers_s, s.wait_s, s.source_hits) == (5.0, 0.0, 4)


def test_read_ahead_never_takes_a_slot_a_queued_call_reads(blobs, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(mx, "async_eval", lambda *a: None)
    model, bank = _bank(blobs, slots=6)
    layer, experts = CALLS[0]
    x, routed = _inputs(experts)
    y = bank.run(layer, model.layers[layer].mlp.switch_mlp._glu, x, routed)
    bank.stage(2, [8, 9, 10, 11, 12, 13])  # only the 2 free slots may take guesses
    bank.settle()  # the reads land first, then the queued call is evaluated
    assert bank.stats.staged == 2
    assert_bitwise(_resident_outputs([CALLS[0]]), [np.array(y.astype(mx.float32))])


class _Sizer:
    """Stands in for ``memory.PoolSizer``: asks for these sizes at these layer calls."""

    def __init__(self, bank: ExpertBank, plan: dict[int, int]) -> None:
        self.bank, self.plan = bank, plan

    def due(self) -> bool:
        return self.bank.stats.layer_calls in self.plan

    def target(self, current: int) -> int | None:
        return self.plan.pop(self.bank.stats.layer_calls)


def test_resizing_the_pool_mid_generation_changes_no_logit(blobs) -> None:  # type: ignore[no-untyped-def]
    """The pool shrinks, grows and shrinks again between layer calls, through the bank's own
    resize path (the sizer asks at a routing read-back); every logit stays the same."""
    ref, toks = run_logits(build_resident(FMT), PROMPT, steps=12)
    model, bank = _bank(blobs, slots=40)
    one = bank.source.entry(1, 0).nbytes  # type: ignore[attr-defined]
    plan = {12: 9 * one, 31: 64 * one, 47: 3 * one}  # mid-forward each time
    bank.sizer = _Sizer(bank, plan)  # type: ignore[assignment]
    got, _ = run_logits(model, PROMPT, toks, steps=12)
    assert_bitwise(ref, got)
    assert not plan and bank.capacity == 3 and len(bank.table) == 3  # type: ignore[arg-type]
    assert bank.stats.ram_hits > 0


class _HostCopier(Copier):
    """The CUDA copier's path with the copy engine replaced by a host memmove: the staging
    buffer, each tensor's address in its slot and the offsets are the ones a GPU would use."""

    def __init__(self) -> None:
        super().__init__()
        self.on = True

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)
        self.copied += nbytes

    def wait(self) -> bool:
        return True


def test_misses_through_staging_and_copies_land_whole_in_their_slots(blobs) -> None:  # type: ignore[no-untyped-def]
    ref, toks = run_logits(build_resident(FMT), PROMPT, steps=6)
    model, bank = _bank(blobs, slots=10)
    bank.fill.copier = _HostCopier()
    got, _ = run_logits(model, PROMPT, toks, steps=6)
    assert_bitwise(ref, got)
    s = bank.stats
    assert bank.fill.copier.copied == s.source_bytes > 0  # every miss went through staging
    assert s.copied_bytes == 2 * s.source_bytes  # into staging, then into the slot


def test_each_window_is_copied_as_soon_as_its_read_lands(blobs) -> None:  # type: ignore[no-untyped-def]
    """The copy to the GPU overlaps the reads after it: the filler copies what the source says
    has landed (``landed(i, n)``: the first n bytes of expert i), window by window, before the
    rest is read. Here each expert lands in three uneven parts that cut across its tensors,
    the staging filled with garbage before each part is written: a copy of bytes not yet
    landed, a part copied twice or a part left out shows as wrong logits or a wrong count."""
    ref, toks = run_logits(build_resident(FMT), PROMPT, steps=2)
    model, bank = _bank(blobs, slots=10)
    events: list[str] = []
    inner = bank.source.read_into

    def read_into(layer, ids, targets, landed=None):  # type: ignore[no-untyped-def]
        events.append(f"batch {len(ids)}")
        scratch = [[bytearray(v.nbytes) for v in t] for t in targets]
        got = inner(layer, ids, [[memoryview(b) for b in t] for t in scratch])
        for i, (target, parts) in enumerate(zip(targets, scratch, strict=True)):
            whole = b"".join(parts)
            flat = [v.cast("B") for v in target]
            for v in flat:
                v[:] = b"\xab" * v.nbytes
            done = 0
            for upto in (len(whole) // 3 + 1, 2 * len(whole) // 3 + 5, len(whole)):
                pos = 0
                for v in flat:  # bytes [done, upto) into the buffers they fall in
                    a, b = max(done, pos), min(upto, pos + v.nbytes)
                    if a < b:
                        v[a - pos:b - pos] = whole[a:b]
                    pos += v.nbytes
                done = upto
                events.append("landed")
                if landed is not None:
                    landed(i, upto)
        return got

    class Logged(_HostCopier):
        def copy(self, dst: int, src: int, nbytes: int) -> None:
            events.append("copy")
            super().copy(dst, src, nbytes)

    bank.source.read_into = read_into
    bank.fill.copier = Logged()
    got, _ = run_logits(model, PROMPT, toks, steps=2)
    assert_bitwise(ref, got)
    s = bank.stats
    assert bank.fill.copier.copied == s.source_bytes > 0  # each byte copied once
    batches = " ".join(events).split("batch ")[1:]
    assert any(int(b.split()[0]) > 1 for b in batches), "the test needs batches of several misses"
    for b in batches:  # landed, its copies, landed, its copies, ...: never two landings in a row
        words = b.split()[1:]
        assert words[0] == "landed" and "landed landed" not in " ".join(words), b


def test_an_expert_read_again_after_a_failed_check_is_copied_again_from_its_start(blobs) -> None:  # type: ignore[no-untyped-def]
    """An expert whose bytes failed their check is read again into the same staging and lands
    again from its first bytes (``landed``'s ``n`` falls back: ``DaemonSource.read_into``); the
    copies to its slot start again from its start, so the slot ends with the second bytes.
    Here the first read of every expert lands garbage, window by window; the second the bytes."""
    ref, toks = run_logits(build_resident(FMT), PROMPT, steps=2)
    model, bank = _bank(blobs, slots=10)
    inner = bank.source.read_into

    def read_into(layer, ids, targets, landed=None):  # type: ignore[no-untyped-def]
        got = inner(layer, ids, targets)  # the right bytes, kept aside
        for i, target in enumerate(targets):
            flat = [v.cast("B") for v in target]
            good = [bytes(v) for v in flat]
            size = sum(v.nbytes for v in flat)
            for v in flat:
                v[:] = b"\x5a" * v.nbytes  # rot, landed window by window
            for upto in (size // 2, size):
                landed(i, upto)
            for v, b in zip(flat, good, strict=True):
                v[:] = b
            landed(i, size)  # read again: lands again, whole
        return got

    bank.source.read_into = read_into
    bank.fill.copier = _HostCopier()
    got, _ = run_logits(model, PROMPT, toks, steps=2)
    assert_bitwise(ref, got)


def _pool_peak_over(bank: ExpertBank, pool_bytes: int) -> int:
    """MLX's peak memory during ``bank.resize(pool_bytes)``, above what it held before."""
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    bank.resize(pool_bytes)
    return mx.get_peak_memory() - before


@pytest.mark.parametrize("new_slots", [30, 52])
def test_a_resize_never_holds_the_old_and_the_new_pool_at_once(blobs, new_slots: int) -> None:  # type: ignore[no-untyped-def]
    """The pool is rebuilt one tensor at a time: shrinking 40 slots to 30 (or growing to 52)
    peaks at the larger pool plus one tensor, not at both pools (70 or 92 slots' worth), and
    the experts kept still compute what the resident layer computes."""
    model, bank = _bank(blobs, slots=40)
    ref, toks = run_logits(build_resident(FMT), PROMPT, steps=3)
    run_logits(model, PROMPT, toks, steps=3)  # fills the pool
    assert bank.memory is not None and bank.table is not None and len(bank.table) == 40
    old = bank.memory.nbytes
    biggest = max(a.nbytes for a in bank.memory.raw.values()) * max(40, new_slots) // 40
    one = bank.source.entry(1, 0).nbytes  # type: ignore[attr-defined]
    peak = _pool_peak_over(bank, new_slots * one)
    new = bank.memory.nbytes
    assert bank.capacity == new_slots and new == old * new_slots // 40
    assert peak <= max(old, new) - old + biggest + 4096, (peak, old, new, biggest)
    hits = bank.stats.ram_hits
    got, _ = run_logits(model, PROMPT, toks, steps=3)  # the same tokens again: kept experts hit
    assert_bitwise(ref, got)
    assert bank.stats.ram_hits > hits


def test_on_cuda_a_resize_moves_slots_by_the_copy_engine(blobs) -> None:  # type: ignore[no-untyped-def]
    """With the copier on (CUDA), the kept slots move by ``cudaMemcpyAsync`` from the old
    tensor's slots to the new one's, one copy a run of consecutive slots, not through host
    views of the GPU's pages; the outputs stay the resident model's."""
    model, bank = _bank(blobs, slots=40)
    ref, toks = run_logits(build_resident(FMT), PROMPT, steps=3)
    run_logits(model, PROMPT, toks, steps=3)
    copier = bank.fill.copier = _HostCopier()
    one = bank.source.entry(1, 0).nbytes  # type: ignore[attr-defined]
    assert bank.memory is not None
    before = bank.stats.copied_bytes
    bank.resize(30 * one)
    kept = 30 * one  # every slot was full: 30 experts' bytes move
    assert copier.copied == bank.stats.copied_bytes - before == kept
    got, _ = run_logits(model, PROMPT, toks, steps=3)
    assert_bitwise(ref, got)


def test_a_resize_that_fails_part_way_drops_the_pool_and_changes_no_logit(blobs, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The third tensor's new array is refused (memory is short: that is when a shrink comes).
    Some tensors then have the new size and some the old, so the bank drops the pool; the same
    model serves the next request bitwise from a new pool of the size asked for."""
    from cachecd_engine.pool import arrays

    ref, toks = run_logits(build_resident(FMT), PROMPT, steps=3)
    model, bank = _bank(blobs, slots=40)
    run_logits(model, PROMPT, toks, steps=3)
    made = []
    real = arrays._aligned

    def refuse_the_third(*a: object) -> mx.array:
        made.append(a)
        if len(made) == 3:
            raise MemoryError("refused")
        return real(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(arrays, "_aligned", refuse_the_third)
    one = bank.source.entry(1, 0).nbytes  # type: ignore[attr-defined]
    with pytest.raises(MemoryError):
        bank.resize(30 * one)
    assert bank.memory is None and bank.table is None
    got, _ = run_logits(model, PROMPT, toks, steps=3)
    assert_bitwise(ref, got)
    assert bank.capacity == 30


def _gated(bank: ExpertBank) -> list[int]:
    """Deferred reads held until ``complete`` asks for them (what a slow disk does to a read
    still under way when the forward goes on); the layers whose reads were deferred."""
    import threading

    gate, deferred = threading.Event(), []
    inner, defer, complete = bank.source.read_into, bank.fill._defer, bank.fill.complete

    def read_into(layer, ids, targets, landed=None):  # type: ignore[no-untyped-def]
        if threading.current_thread() is not threading.main_thread():
            assert gate.wait(60), "nothing completed the deferred read"
        return inner(layer, ids, targets, landed)

    def spy(layer: int, claimed: dict[int, int]) -> None:
        gate.clear()
        deferred.append(layer)
        defer(layer, claimed)

    def completing() -> None:
        gate.set()
        complete()

    bank.source.read_into = read_into  # type: ignore[method-assign]
    bank.fill._defer = spy  # type: ignore[method-assign]
    bank.fill.complete = completing  # type: ignore[method-assign]
    return deferred


@pytest.mark.parametrize("ahead", [False, True])
def test_deferred_reads_change_no_logit(blobs, ahead: bool) -> None:  # type: ignore[no-untyped-def]
    """With ``defer_reads`` a call's misses are read on the filler's thread while the forward
    goes on; nothing reads their slots before ``complete`` (held here until then: a call
    queued early would compute from slots not yet written), and the last MoE layer's call
    never leaves a read behind (mlx-lm evaluates after it). With read-ahead too, its guesses
    claimed and read while a deferred read is under way."""
    from cachecd_engine.streamed_moe import install_prefetch

    ref, toks = run_logits(build_resident(FMT), PROMPT, steps=6)
    model, bank = _bank(blobs, slots=10)  # fewer than a token's experts: misses every layer
    if ahead:
        install_prefetch(model, bank)
    bank.defer_reads = True
    deferred = _gated(bank)
    got, _ = run_logits(model, PROMPT, toks, steps=6)
    assert_bitwise(ref, got)
    assert len(deferred) >= 6 and max(bank.last_layers) not in deferred
    assert not bank.fill.deferred


def test_a_deferred_read_that_fails_frees_its_slots_and_changes_no_logit(blobs) -> None:  # type: ignore[no-untyped-def]
    """The read fails on the filler's thread: the next call raises it, the slots it claimed
    are freed, and the same model then computes the resident logits."""
    import threading

    ref, toks = run_logits(build_resident(FMT), PROMPT, steps=4)
    model, bank = _bank(blobs, slots=10)
    bank.defer_reads = True
    inner, failed = bank.source.read_into, []

    def read_into(layer, ids, targets, landed=None):  # type: ignore[no-untyped-def]
        if threading.current_thread() is not threading.main_thread() and not failed:
            failed.append(layer)
            inner(layer, ids[:1], targets[:1])  # one expert lands, then the read fails
            raise OSError("disk gone")
        return inner(layer, ids, targets, landed)

    bank.source.read_into = read_into  # type: ignore[method-assign]
    with pytest.raises(OSError, match="disk gone"):
        run_logits(model, PROMPT, toks, steps=4)
    assert failed and not bank.fill.deferred
    assert bank.table is not None and not bank.table.unfilled()
    got, _ = run_logits(model, PROMPT, toks, steps=4)
    assert_bitwise(ref, got)


def test_on_cuda_read_ahead_goes_through_its_threads_own_copier(blobs) -> None:  # type: ignore[no-untyped-def]
    """Read-ahead on CUDA: each reader thread reads a guess into its own staging and copies it
    to the slot on its own stream (host writes into the GPU's pages were what made read-ahead
    slow there), the copies done before the read lands; the logits stay the resident ones and
    every byte read ahead went through a reader's copier."""
    import threading

    from cachecd_engine.streamed_moe import install_prefetch

    ref, toks = run_logits(build_resident(FMT), PROMPT, steps=6)
    model, bank = _bank(blobs, slots=14)
    install_prefetch(model, bank)
    threads: set[str] = set()

    class Threaded(_HostCopier):
        def copy(self, dst: int, src: int, nbytes: int) -> None:
            threads.add(threading.current_thread().name)
            super().copy(dst, src, nbytes)

    bank.fill.copier = Threaded()
    got, _ = run_logits(model, PROMPT, toks, steps=6)
    assert_bitwise(ref, got)
    bank.settle()  # read-ahead still under way lands (and is counted)
    s = bank.stats
    ahead = sum(c.copied for c in bank.fill._ahead_copiers)
    assert s.staged > 0 and ahead > 0
    assert bank.fill.copier.copied + ahead == s.source_bytes  # every byte read went to a copier
    assert any(name.startswith("cachecd-ahead") for name in threads), threads
    bank.close()
