"""The bank's own host work per layer call (``EngineStats.plan_s``) at K3's depth, nothing else.

Drives the real decode path (``ExpertBank.run``: ``Filler.acquire``, ``SlotTable``,
``LayerCycle``, the call's indices and the gather) over 92 MoE layers of 896 experts with
K3-statistics routing (``cycle_traces``: 29.5% reuse, the router's forecast given to the table
before each call as ``Prefetcher.forecast`` does), from an in-process source of tiny fp32
experts: a read costs a copy of a few hundred bytes and the gather next to nothing, so what is
left is the host work the bank adds to every layer call whatever the expert size. Each call is
preceded by the per-layer read-back's bookkeeping (``fenced``/``synced``), as
``StreamedSwitchGLU`` does.

Cases: top-16 (K3) and top-4 (the H200's 92-layer run: 122 slots), pools of a third of a
token's experts, one token's, and ``--slots`` (a Mac's pool: 64 GB of K3 experts is ~3,650);
``hit``: the same tokens again once the pool holds them (every expert a hit), ``miss``: new
tokens (a pool smaller than the working set misses most). Per case: plan_s per layer call, the
whole call's host time per layer call, hits, and the time a token spends getting the
speculative step's device map (``DeviceMap.array`` after its calls: made again if the table
changed; built whole once before the measured tokens). ``decisions`` is a digest of
every slot the bank gave every expert and of the table's counters: equal digests before and
after a change mean the same slots, victims and hits. ``--profile`` prints cProfile's top
entries (by own time) over the measured calls of each case.

    python bench/bank_host.py [--cases top4-122-miss,...] [--tokens 6] [--slots 4000]
        [--profile 12]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import hashlib
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from cycle_traces import K3, CycleTrace, generate  # noqa: E402

from cachecd.manifest.entries import ByteRange, ExpertEntry, TensorInfo  # noqa: E402
from cachecd_engine.formats import QUANT_SPECS  # noqa: E402
from cachecd_engine.pool.bank import EngineStats, ExpertBank  # noqa: E402
from cachecd_engine.pool.speculate import DeviceMap  # noqa: E402
from cachecd_engine.streamed_moe import as_template  # noqa: E402

LAYERS, EXPERTS = 92, 896
DIMS, HIDDEN = 8, 4  # a tiny fp32 expert: 3 x 128 bytes
SPEC = QUANT_SPECS["none"]


class TinySource:
    """Every expert the same tiny fp32 tensors (one manifest entry serves all: the bank reads
    only its layout); reads copy those bytes."""

    def __init__(self) -> None:
        shapes = {"w1": (HIDDEN, DIMS), "w2": (DIMS, HIDDEN), "w3": (HIDDEN, DIMS)}
        prefix = "language_model.model.layers.0.block_sparse_moe.experts.0."
        tensors, offsets, pos = [], [], 0
        for w, shape in sorted(shapes.items()):
            n = 4 * shape[0] * shape[1]
            tensors.append(TensorInfo(f"{prefix}{w}.weight", "F32", shape, "m", pos, n, b""))
            offsets.append(pos)
            pos += n
        self.blob = np.full(pos // 4, 0.01, np.float32).tobytes()
        self._entry = ExpertEntry(0, 0, pos, b"", (ByteRange("m", 0, pos),), tuple(tensors),
                                  tuple(offsets))

    def read_into(self, layer, ids, targets, done=None):  # type: ignore[no-untyped-def]
        written = 0
        for i, target in enumerate(targets):
            pos = 0
            for v in target:
                v[:] = self.blob[pos : pos + v.nbytes]
                pos += v.nbytes
            written += pos
            if done is not None:
                done(i)
        return written

    def entry(self, layer: int, expert: int) -> ExpertEntry:
        return self._entry

    def prefetch(self, layer: int, ids: list[int]) -> None:
        pass


@dataclasses.dataclass
class Case:
    name: str
    top_k: int
    slots: int
    hit: bool  # the measured tokens are the warm-up's again (the pool holds them)


def cases(slots: int) -> list[Case]:
    out = []
    for k in (4, 16):
        token = LAYERS * k
        out.append(Case(f"top{k}-{token // 3}-miss", k, token // 3, False))
        for n in (token, slots):
            out += [Case(f"top{k}-{n}-hit", k, n, True), Case(f"top{k}-{n}-miss", k, n, False)]
    return out


@dataclasses.dataclass
class Result:
    calls: int
    plan_s: float
    call_s: float  # the whole of bank.run, read-back bookkeeping included
    hits: int
    routed: int
    map_s: float  # DeviceMap.array rebuilds, summed
    maps: int
    decisions: str
    profile: str = ""


def _bank(slots: int) -> tuple[ExpertBank, SwitchGLU]:
    source = TinySource()
    bank = ExpertBank(source, SPEC, 0, EngineStats(), experts_per_layer=EXPERTS)
    bank.min_slots = slots  # a pool of 0 bytes gets the least a default pool gets: these
    glu = as_template(SwitchGLU(DIMS, HIDDEN, EXPERTS), SPEC)
    bank.attach(glu)
    bank.prepare(0)
    assert bank.capacity == slots, (bank.capacity, slots)
    return bank, glu


def _token(bank: ExpertBank, glu: SwitchGLU, x: mx.array, trace: CycleTrace, t: int,
           digest: Any) -> float:
    """One token's layer calls; the host time of the calls (bank.run and the read-back's
    bookkeeping, not the read-back's wait)."""
    host = 0.0
    for layer in range(LAYERS):
        fenced = bank.fenced()
        mx.eval(*fenced)  # the read-back: earlier calls' compute
        t0 = time.perf_counter()
        bank.synced(fenced)
        if layer > 0 and bank.table is not None:  # the previous layer's forecast of this one
            bank.table.forecast(layer, trace.forecast[t, layer - 1].tolist())
        routed = trace.routed[t, layer].reshape(1, 1, -1).astype(np.int64)
        y = bank.run(layer, glu, x, routed)
        host += time.perf_counter() - t0
        if digest is not None:
            assert bank.table is not None
            digest.update(str([(e, bank.table.slot((layer, e)))
                               for e in trace.routed[t, layer].tolist()]).encode())
        del y
    return host


def measure(case: Case, tokens: int, seed: int = 0, profile: int = 0) -> Result:
    warm = 1 if case.hit else 2
    per_pass = max(1, case.slots // (LAYERS * case.top_k)) if case.hit else tokens
    spec = dataclasses.replace(K3, top_k=case.top_k, hot=case.top_k,
                               tokens=warm + max(per_pass, 1) + tokens, seed=seed)
    trace = generate(spec)
    bank, glu = _bank(case.slots)
    x = mx.ones((1, 1, DIMS))
    digest = hashlib.sha256()
    if case.hit:  # the pool is filled with per_pass tokens, then they come again and again
        for t in range(per_pass):
            _token(bank, glu, x, trace, t, digest)
        order = [t % per_pass for t in range(tokens)]
    else:
        for t in range(warm):
            _token(bank, glu, x, trace, t, digest)
        order = list(range(warm, warm + tokens))
    s = bank.stats
    s.reset()
    dmap = DeviceMap(bank, list(range(LAYERS)))
    dmap.array()  # built whole once, as the first speculative step does: then per token
    prof = cProfile.Profile() if profile else None
    call_s = map_s = 0.0
    for t in order:
        if prof is not None:
            prof.enable()
        call_s += _token(bank, glu, x, trace, t, digest)
        t0 = time.perf_counter()
        dmap.array()
        map_s += time.perf_counter() - t0
        if prof is not None:
            prof.disable()
    mx.eval(*bank.fenced())
    assert bank.table is not None
    c = bank.table.counters
    digest.update(str((c.hits, c.misses, c.inserted, c.evicted)).encode())
    text = ""
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(profile)
        text = out.getvalue()
    bank.close()
    return Result(s.layer_calls, s.plan_s, call_s, s.ram_hits, s.experts_routed, map_s,
                  len(order), digest.hexdigest()[:16], text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--tokens", type=int, default=6, help="measured tokens a case")
    ap.add_argument("--slots", type=int, default=4000, help="the large pool (a Mac's)")
    ap.add_argument("--profile", type=int, default=0, help="print this many profile entries")
    args = ap.parse_args(argv)
    chosen = [c for c in cases(args.slots) if not args.cases or c.name in args.cases.split(",")]
    print("| case | slots | plan us/call | host us/call | hit rate | map ms/token | decisions |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for case in chosen:
        r = measure(case, args.tokens, profile=args.profile)
        plan = 1e6 * r.plan_s / r.calls
        worst = max(worst, plan)
        print(f"| {case.name} | {case.slots} | {plan:.1f} | {1e6 * r.call_s / r.calls:.1f} | "
              f"{r.hits / r.routed:.3f} | {1e3 * r.map_s / r.maps:.2f} | {r.decisions} |",
              flush=True)
        if r.profile:
            print(r.profile, flush=True)
    print(f"plan_us_per_call_max={worst:.1f}")


if __name__ == "__main__":
    main()
