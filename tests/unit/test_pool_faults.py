"""No failure leaves a slot of the pool wrong: an exception raised at each step of getting experts
into slots (a claim, a read, the evaluation of a slot's queued readers, the wait for read-ahead,
a derive), for every expert format, then the same model keeps serving, bitwise the resident
model's, and its pool still resizes.

The fault points are named, as the daemon's crash matrix names its kill points
(``tests/faults/test_s01_crash.py``); each one patches the real function at its boundary and
raises ``Injected`` there once: a ``BaseException`` as an allocation failure or Ctrl-C would be
when it comes as ``KeyboardInterrupt``, so no ``except Exception`` may swallow it. A point that
does not fire in its request fails the test.

Two scenarios reach every point: a cold pool of 8 slots (a prefill in groups: claims, reads,
claims of slots a queued group reads, derives), and the same pool with 6 slots being read ahead
(gated, so they are still filling when the request asks for slots: the claim waits for them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from cachecd import errors
from cachecd.testbed.tiny_k2 import K2Options, write_tiny_k2
from cachecd.testbed.tiny_model import write_tiny_model
from cachecd_engine.formats import StackLayout, quant_spec
from cachecd_engine.loader import load
from cachecd_engine.local_source import LocalSource, manifest_from_dir
from cachecd_engine.pool import arrays as pool
from cachecd_engine.pool.arrays import PoolMemory
from cachecd_engine.pool.fill import Filler
from cachecd_engine.pool.slots import SlotTable
from tests.exactness import assert_bitwise, run_logits

PROMPT = [(7 * i + 3) % 300 for i in range(16)]
STEPS = 3
SLOTS = 8  # the prefill routes to nearly all 32 experts a layer: groups of 4
FORMATS = ["mxfp4", "plain", "int4", "fp8"]
DERIVED = {"int4", "fp8"}  # formats whose kernel arrays are computed from the bytes


class Injected(BaseException):
    """Raised at a fault point."""


class Fault:
    """Fires once at ``point`` while armed."""

    def __init__(self, point: str) -> None:
        self.point, self.armed, self.fired = point, False, 0

    def take(self, point: str) -> bool:
        if self.armed and point == self.point and not self.fired:
            self.fired += 1
            return True
        return False

    def hit(self, point: str) -> None:
        if self.take(point):
            raise Injected(point)


def _checkpoint(fmt: str, root: Path) -> tuple[Any, ...]:
    """A tiny checkpoint of ``fmt``, its manifest, and the resident model's logits and tokens."""
    if fmt in ("mxfp4", "plain"):
        full = write_tiny_model(root / "full", seed=3, fmt="fp32" if fmt == "plain" else fmt)
    else:
        opts = K2Options(fmt=fmt, moe_intermediate=192) if fmt == "fp8" else K2Options()
        full = write_tiny_k2(root / "full", opts, seed=3).out
    manifest = manifest_from_dir(full, repo=f"cachecd/faults-{fmt}")
    reference, _ = load_model(full)
    ref, toks = run_logits(reference, PROMPT, steps=STEPS)
    return fmt, full, manifest, ref, toks, reference


@pytest.fixture(scope="module", params=FORMATS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return _checkpoint(request.param, tmp_path_factory.mktemp(f"faults-{request.param}"))


def _slot_bytes(manifest: Any) -> int:
    layer = manifest.moe_layers[0]
    return PoolMemory.slot_nbytes(quant_spec(manifest.quant_format),
                                  StackLayout.of(manifest.expert(layer, 0)))


def _load(full: Path, source: LocalSource, slots: int, **kw: Any) -> Any:
    model, _ = load(full, source, ram_bytes=slots * _slot_bytes(source.manifest), **kw)
    assert model.bank.capacity == slots
    return model


def _patch_claim(monkeypatch: pytest.MonkeyPatch, after: Callable[[Any], None]) -> None:
    real = SlotTable.claim

    def claim(self: SlotTable, *args: Any, **kw: Any) -> Any:
        got = real(self, *args, **kw)
        if kw.get("use"):
            after(got)
        return got

    monkeypatch.setattr(SlotTable, "claim", claim)


def _install(point: str, fault: Fault, source: LocalSource,
             monkeypatch: pytest.MonkeyPatch) -> None:
    """Patch the real function at ``point``'s boundary to raise there once."""
    if point == "claim":  # the table has given slots; the caller never sees them
        _patch_claim(monkeypatch, lambda got: fault.hit("claim") if got.slots else None)
    elif point == "fence_eval":  # evaluating the queued readers of the slots a claim took
        fences: list[Any] = []
        _patch_claim(monkeypatch, lambda got: fences.extend(got.fences))
        real_eval = mx.eval

        def evaluate(*args: Any) -> Any:
            flat = [a for arg in args for a in (arg if isinstance(arg, list) else [arg])]
            if any(a is f for a in flat for f in fences):
                fault.hit("fence_eval")
            return real_eval(*args)

        monkeypatch.setattr(mx, "eval", evaluate)
    elif point == "read":  # the first expert of a demand read landed, then the read fails
        real_read = source.read_into

        def read_into(layer, ids, targets, landed=None):  # type: ignore[no-untyped-def]
            if threading.current_thread() is threading.main_thread() and fault.take("read"):
                real_read(layer, ids[:1], targets[:1])
                raise Injected("read")
            return real_read(layer, ids, targets, landed)

        monkeypatch.setattr(source, "read_into", read_into)
    elif point in ("derive", "derive_staged"):  # sanitize's ops over freshly filled slots
        real_finish = pool.finish
        monkeypatch.setattr(pool, "finish", lambda *a: fault.hit(point) or real_finish(*a))
    elif point == "finish_all":  # the claim waits for read-ahead to land
        real_all = Filler.finish_all

        def finish_all(self: Filler) -> None:
            fault.hit("finish_all")
            real_all(self)

        monkeypatch.setattr(Filler, "finish_all", finish_all)


def _gate_read_ahead(source: LocalSource, monkeypatch: pytest.MonkeyPatch, fault: Fault) -> None:
    """Read-ahead (reader threads) lands only once the model's thread waits for it; the
    ``finish_wait`` point raises inside that wait."""
    gate, real_read, real_exc = threading.Event(), source.read_into, Future.exception

    def read_into(layer, ids, targets, landed=None):  # type: ignore[no-untyped-def]
        if threading.current_thread() is not threading.main_thread():
            assert gate.wait(60), "nothing waited for the read-ahead"
        return real_read(layer, ids, targets, landed)

    def exception(self: Future, timeout: float | None = None) -> Any:  # type: ignore[type-arg]
        gate.set()
        fault.hit("finish_wait")
        return real_exc(self, timeout)

    monkeypatch.setattr(source, "read_into", read_into)
    monkeypatch.setattr(Future, "exception", exception)


def test_a_claim_undone_before_its_readers_ran_keeps_their_fence() -> None:
    """The table's half: a slot taken from queued readers and freed again (the claim undone
    before those readers were evaluated) is not given out as a plain free slot."""
    t = SlotTable(2, policy="lru")
    t.filled(t.claim(1, [0, 1]).slots.values())
    reader = object()
    t.fence([0, 1], reader)
    got = t.claim(2, [5])
    slot = got.slots[5]
    assert got.fences == [reader]
    t.forget([slot])  # the wait for ``reader`` raised
    assert t.claim(2, [6], take_fenced=False).slots == {}
    again = t.claim(2, [6])
    assert again.slots == {6: slot} and again.fences == [reader]
    t.clear_fences([reader])  # the evaluation that included it returned
    t.forget([slot])
    assert t.claim(2, [7], take_fenced=False).slots == {7: slot}


COLD = ["claim", "read", "fence_eval", "derive"]
AHEAD = ["finish_all", "finish_wait", "derive_staged"]


@pytest.mark.parametrize("point", COLD + AHEAD)
def test_a_fault_at_each_step_leaves_no_slot_wrong(checkpoint, point: str,  # type: ignore[no-untyped-def]
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fmt, full, manifest, ref, toks, _ = checkpoint
    if point.startswith("derive") and fmt not in DERIVED:
        pytest.skip(f"{fmt} derives nothing from the bytes")
    fault = Fault(point)
    with LocalSource(manifest, full) as source:
        model = _load(full, source, SLOTS, prefetch=False, speculate=False)
        bank = model.bank
        try:
            if point in AHEAD:
                _gate_read_ahead(source, monkeypatch, fault)
                bank.stage(manifest.moe_layers[-1], list(range(SLOTS - 2)))
            _install(point, fault, source, monkeypatch)
            fault.armed = True
            with pytest.raises(Injected):
                run_logits(model, PROMPT, toks, steps=STEPS)
            assert fault.fired, f"the fault point {point} did not fire"
            # The same model serves the next requests, bitwise, and its pool still resizes.
            got, _ = run_logits(model, PROMPT, toks, steps=STEPS)
            assert_bitwise(ref, got)
            bank.resize(12 * _slot_bytes(manifest))
            assert bank.capacity == 12
            got, _ = run_logits(model, PROMPT, toks, steps=STEPS)
            assert_bitwise(ref, got)
        finally:
            bank.close()


def test_a_call_that_cannot_fit_frees_what_it_claimed(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The check after the claims (more experts than the pool has slots) is an error the
    server answers and keeps serving: the slots claimed before it are free again."""
    _, full, manifest, ref, toks, _ = checkpoint
    with LocalSource(manifest, full) as source:
        model = _load(full, source, SLOTS, prefetch=False, speculate=False)
        bank = model.bank
        with pytest.raises(errors.InvalidRequest, match="do not fit"):
            bank.load_stack(manifest.moe_layers[0], list(range(SLOTS + 1)))
        got, _ = run_logits(model, PROMPT, toks, steps=STEPS)
        assert_bitwise(ref, got)
        bank.resize(12 * _slot_bytes(manifest))
        got, _ = run_logits(model, PROMPT, toks, steps=STEPS)
        assert_bitwise(ref, got)
        bank.close()


PROMPT_B = [(11 * i + 5) % 300 for i in range(12)]


def test_two_prompt_caches_interleaved_with_speculation(tmp_path_factory,  # type: ignore[no-untyped-def]
                                                        monkeypatch) -> None:
    """Two conversations on one model, one decode step of each in turn, each step's logits
    left queued while the other's runs (``mx.async_eval`` a no-op: MLX computes only when
    asked). Speculative steps are on and the pool holds a fraction of the working set, so
    steps are kept and thrown away and slots refilled while the other cache's step still
    reads them; every logit of both is bitwise the resident model's."""
    _, full, manifest, _, _, reference = _checkpoint("mxfp4", tmp_path_factory.mktemp("spec"))
    steps = 10
    refs = [run_logits(reference, p, steps=steps) for p in (PROMPT, PROMPT_B)]
    monkeypatch.setattr(mx, "async_eval", lambda *a: None)
    with LocalSource(manifest, full) as source:
        model = _load(full, source, 150, prefetch=False, speculate=True)  # of 160: some kept
        caches = [make_prompt_cache(model) for _ in refs]
        pending = [model(mx.array(p)[None], cache=c) for p, c in zip((PROMPT, PROMPT_B), caches,
                                                                     strict=True)]
        outs: list[list[np.ndarray]] = [[], []]
        for step in range(steps + 1):
            for i, (_, toks) in enumerate(refs):
                outs[i].append(np.array(pending[i].astype(mx.float32)))
                if step < steps:
                    pending[i] = model(mx.array([[toks[step]]]), cache=caches[i])
        spec = model.bank.speculator
        model.bank.close()
    for (ref, _), got in zip(refs, outs, strict=True):
        assert_bitwise(ref, got)
    assert spec.kept > 0 and spec.missed > 0
