"""The K3 table of docs/plan.md: `cachecd plan`'s model applied to published Mac figures.

Nothing here is measured on a Mac. Each row is the plan's projection for exact Kimi K3 (the
synthetic K3 manifest of ``manifest_load.py``: 92 MoE layers x 896 experts of 17,547,264 bytes,
top-16, 25.8 GB routed a token) with flat routing (as before issue 37) and with decode traces of
K3's published routing statistics (``cycle_traces.K3``: reuse, hot set; replayed through the
engine's slot table and its default policy), the whole model on disk (budget 1.446 TB),
the pool the engine's default rule gives the Mac's memory (its cap: half of it), and an SSD read
rate from a published figure (docs/plan.md names each source). Compute and the engine's per-call
costs are left out (0 ms): each figure is an upper bound set by the SSD.

    python bench/plan_macs.py [--tokens 16] [--k3-tokens 120] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from cycle_traces import K3, generate
from manifest_load import synthetic_k3

from cachecd.plan import simulate
from cachecd.plan.plan import Inputs, project_row
from cachecd.plan.routing import Workload, flat
from cachecd.plan.simulate import slot_bytes
from cachecd.plan.speed import Machine

GB = 10**9
GIB = 1 << 30
# (Mac, memory GiB, SSD read GB/s): M5 Pro 17.3 at QD 8 and M5 Max 13.6 (DESIGN.md, from the
# published streamer's report and The Verge's M5 Max test); M4 Pro/Max 7.3 = 13.6 / 1.86 (The
# Verge: the M5 Max reads 86% faster than its M4 counterpart).
MACS = (("M4 Pro", 64, 7.3), ("M4 Max", 128, 7.3), ("M5 Pro", 64, 17.3), ("M5 Pro", 128, 17.3),
        ("M5 Max", 64, 13.6), ("M5 Max", 128, 13.6))
SSDS = (1, 2)  # cache dirs on this many such SSDs, reads spread evenly (an assumption)


def k3_statistics(manifest: Any, tokens: int, seed: int) -> Workload:
    """A ``cycle_traces`` K3 trace as the plan's workload (decode calls, the manifest's layers)."""
    trace = generate(dataclasses.replace(K3, tokens=tokens, seed=seed))
    layers = manifest.moe_layers
    calls = [(int(layers[m]), ids, True) for m, ids, _ in trace.calls()]
    return Workload(calls, tokens, f"K3 statistics, seed {seed}, {tokens} tokens", 16)


def _replay_once() -> None:
    """Each pool size's replay once: the rows of one pool differ only in the SSD's rate."""
    done: dict[tuple[int, int, int], Any] = {}
    replay = simulate.replay

    def cached(manifest: Any, work: Any, slots: int, budget: int, **kw: Any) -> Any:
        key = (id(work), slots, budget)
        if key not in done:
            done[key] = replay(manifest, work, slots, budget, **kw)
        return done[key]

    simulate.replay = cached  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16, help="flat-routing tokens counted")
    ap.add_argument("--k3-tokens", type=int, default=120, help="K3-statistics trace tokens")
    ap.add_argument("--seed", type=int, default=0, help="the K3-statistics trace's seed")
    args = ap.parse_args()
    _replay_once()
    m = synthetic_k3()
    works = {"flat": flat(m, 16, args.tokens), "k3": k3_statistics(m, args.k3_tokens, args.seed)}
    print("| Mac | memory | pool (default) | SSDs | SSD read | pool hits, flat | tok/s, flat "
          "| pool hits, K3 statistics | tok/s, K3 statistics |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, mem, rate in MACS:
        total = mem * GIB
        pool = total // 2  # the default's cap (POOL_CAP_SHARE) when the resident model leaves room
        for n in SSDS:
            machine = Machine(total, total, None, n * rate * GB, n * rate * GB, None, None)
            rows = {k: project_row(Inputs(m, machine, 0.0, pool, slot_bytes(m)), w, pool,
                                   m.expert_bytes_total, seed=0) for k, w in works.items()}
            f, k = rows["flat"], rows["k3"]
            print(f"| {name} | {mem} GB | {pool / GIB:.0f} GiB | {n} | {n * rate:.1f} GB/s | "
                  f"{f['pool_hit_rate']:.1%} | {f['tok_s_cold']:.2f} | "
                  f"{k['pool_hit_rate']:.1%} | {k['tok_s_cold']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
