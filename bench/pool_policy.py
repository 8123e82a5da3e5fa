"""The pool's policy: hit rates of decode traces replayed through the engine's own ``SlotTable``
as the bank drives it (``cachecd.plan.simulate.through_pool``: the call's experts looked up,
the misses claimed with the call's held slots kept, queued readers fenced), the router's
forecast of the next layer given to the table before each call as ``Prefetcher`` gives it.

Pools of 0.5, 1, 2, 4 and 8 steps' worth of slots (a step: one token's experts, MoE layers x
top-k). Policies, each admitting every miss (the kernel reads only the pool) unless named:
- ``cycle``: the default (``cachecd_engine.pool.cycle.LayerCycle``), with the forecast;
  ``cycle-nf``: the same without it; ``cycle+ahead``: with the forecast read ahead too (hits of
  experts read ahead count: not comparable to Belady's, which reads only on demand).
- ``wlfu``: the default before issue 37 (windowed LFU, admission by use counts).
- ``lru``, ``lfu`` (perfect LFU), ``belady`` (MIN: the most any policy can hit), and on the
  K3-statistics traces ``oracle`` (``pool_rankers.Oracle``: ranks by the generator's own law,
  the online ceiling argued for in bench/README.md).

Traces: ``k3`` (92 MoE layers x 896 experts, top-16, K3's published statistics, several seeds;
``cycle_traces``), ``k3-scaled`` (the same statistics at issue 37's held-out scale: 6 MoE layers
x 256 experts, top-4, 400 tokens) and ``synth`` (the project's own synthetic routing,
``traces.SynthSpec``: Zipf popularity that drifts, bursty sequences, prefill calls, no forecast).
The first quarter of a K3-statistics trace, and the train part of ``synth``, warm the pool;
hit rates count the decode calls after it.

    python bench/pool_policy.py [--families k3-scaled,synth,k3] [--seeds 3] [--k3-tokens 160]
        [--scaled-tokens 400] [--synth-tokens 3000]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from cycle_traces import K3, SCALED, CycleTrace, generate, later_ranks  # noqa: E402
from pool_rankers import Belady, Lfu, Lru, Oracle  # noqa: E402
from traces import KEY_STRIDE, Stream, SynthSpec, synthetic  # noqa: E402

from cachecd.plan.simulate import through_pool  # noqa: E402
from cachecd_engine.pool.slots import SlotTable  # noqa: E402

STEPS = (0.5, 1, 2, 4, 8)
# (layer, experts, the guess for the next layer or None, counted)
Call = tuple[int, list[int], "list[int] | None", bool]
SYNTH = SynthSpec(name="synth", layers=16, experts=256, top_k=8, tokens=3_000, seq_len=(64, 256))


@dataclasses.dataclass
class Trace:
    name: str
    calls: list[Call]
    step: int  # one token's experts: MoE layers x top-k
    experts: int  # per layer
    cycle: CycleTrace | None = None


def cycle_trace(trace: CycleTrace) -> Trace:
    calls = trace.calls()
    warm = len(calls) // 4 // trace.spec.layers * trace.spec.layers
    return Trace(f"{trace.spec.name}/s{trace.spec.seed}",
                 [(m, ids, g, i >= warm) for i, (m, ids, g) in enumerate(calls)],
                 trace.spec.layers * trace.spec.top_k, trace.spec.experts, trace)


def synth_trace(spec: SynthSpec) -> Trace:
    split = synthetic(spec)
    calls = _stream_calls(split.train, spec.top_k, False) + _stream_calls(split.test, spec.top_k,
                                                                         True)
    return Trace(f"{spec.name}/s{spec.seed}", calls, spec.layers * spec.top_k, spec.experts)


def _stream_calls(stream: Stream, top_k: int, counted: bool) -> list[Call]:
    ends = np.append(stream.starts[1:], stream.keys.size)
    out: list[Call] = []
    for a, b in zip(stream.starts.tolist(), ends.tolist(), strict=True):
        keys = stream.keys[a:b]
        layer = int(keys[0] // KEY_STRIDE)
        ids = list(dict.fromkeys((keys % KEY_STRIDE).tolist()))
        out.append((layer, ids, None, counted and b - a == top_k))
    return out


def policies(trace: Trace, slots: int) -> dict[str, Callable[[], Any]]:
    """Each policy's table, built fresh."""
    n = trace.experts  # as the bank makes its table: the experts a layer has
    out: dict[str, Callable[[], Any]] = {
        "cycle": lambda: SlotTable(slots, "cycle", n),
        "cycle-nf": lambda: SlotTable(slots, "cycle", n),
        "cycle+ahead": lambda: SlotTable(slots, "cycle", n),
        "wlfu": lambda: SlotTable(slots, "wlfu"),
        "lru": lambda: SlotTable(slots, Lru(slots)),
        "lfu": lambda: SlotTable(slots, Lfu(slots)),
        "belady": lambda: SlotTable(slots, Belady(slots, [(m, sorted(set(ids)))
                                                          for m, ids, _, _ in trace.calls])),
    }
    if trace.cycle is not None:
        c = trace.cycle
        out["oracle"] = lambda: SlotTable(slots, Oracle(
            slots, c.keep, c.popularity, c.spec.top_k, c.spec.rank1, later_ranks(c.spec)))
    return out


def replay(table: Any, calls: Sequence[Call], forecast: bool = True,
           ahead: bool = False) -> float:
    """The share of the counted calls' experts the pool held (read ahead included). With
    ``ahead`` the guess is read ahead after the call, as ``Filler.stage`` does: free slots and
    slots ranked below the guess only (``SlotTable.claim(ahead=True)``), each read landing
    before the next call (a disk fast enough for one layer's guess per layer call)."""
    hits = asked = 0
    for layer, ids, guess, counted in calls:
        if forecast and guess is not None:
            table.forecast(layer + 1, guess)
        _, held = through_pool(table, layer, ids)
        if counted:
            hits, asked = hits + len(held), asked + len(ids)
        if ahead and guess is not None:
            todo = [e for e in dict.fromkeys(guess) if (layer + 1, e) not in table]
            table.filled(table.claim(layer + 1, todo, take_fenced=False, ahead=True)
                         .slots.values())
    return hits / asked


def run(traces: list[Trace]) -> dict[str, dict[float, dict[str, list[float]]]]:
    """family -> steps -> policy -> hit rate per trace (seed)."""
    out: dict[str, dict[float, dict[str, list[float]]]] = {}
    for trace in traces:
        family = trace.name.split("/")[0]
        for steps in STEPS:
            slots = max(2, int(steps * trace.step))
            for name, make in policies(trace, slots).items():
                t0 = time.perf_counter()
                rate = replay(make(), trace.calls, forecast=name != "cycle-nf",
                              ahead=name == "cycle+ahead")
                out.setdefault(family, {}).setdefault(steps, {}).setdefault(name, []).append(rate)
                print(f"# {trace.name} steps={steps} slots={slots} {name}={rate:.3f} "
                      f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    return out


def table(results: dict[str, dict[float, dict[str, list[float]]]]) -> list[str]:
    names = ["cycle", "cycle-nf", "cycle+ahead", "wlfu", "lru", "lfu", "oracle", "belady"]
    lines = ["| trace | steps' worth | " + " | ".join(names) + " | cycle / belady |",
             "|---|---|" + "---|" * (len(names) + 1)]
    for family, by_steps in results.items():
        for steps, by_policy in by_steps.items():
            mean = {n: float(np.mean(v)) for n, v in by_policy.items()}
            cells = [f"{mean[n]:.3f}" if n in mean else "-" for n in names]
            ratio = mean["cycle"] / mean["belady"] if mean["belady"] else 0.0
            lines.append(f"| {family} | {steps:g} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="k3-scaled,synth,k3")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--k3-tokens", type=int, default=K3.tokens)
    ap.add_argument("--scaled-tokens", type=int, default=SCALED.tokens)
    ap.add_argument("--synth-tokens", type=int, default=SYNTH.tokens)
    args = ap.parse_args(argv)
    traces: list[Trace] = []
    for family in args.families.split(","):
        for seed in range(args.seeds):
            if family == "k3":
                spec = dataclasses.replace(K3, tokens=args.k3_tokens, seed=seed)
                traces.append(cycle_trace(generate(spec)))
            elif family == "k3-scaled":
                spec = dataclasses.replace(SCALED, tokens=args.scaled_tokens, seed=seed)
                traces.append(cycle_trace(generate(spec)))
            else:
                traces.append(synth_trace(dataclasses.replace(SYNTH, tokens=args.synth_tokens,
                                                              seed=seed)))
    results = run(traces)
    print("\n".join(table(results)))
    worst = min(np.mean(r["cycle"]) / max(np.mean(r["lru"]), np.mean(r["lfu"]))
                for by in results.values() for r in by.values())
    print(f"ratio={worst:.3f}")  # the default over the better of LRU and LFU, worst case


if __name__ == "__main__":
    main()
