"""The K3 table of docs/plan.md: `cachecd plan`'s model applied to published Mac figures.

Nothing here is measured on a Mac. Each row is the plan's projection for exact Kimi K3 (the
synthetic K3 manifest of ``manifest_load.py``: 92 MoE layers x 896 experts of 17,547,264 bytes,
top-16, 25.8 GB routed a token) with flat routing, the whole model on disk (budget 1.446 TB),
the pool the engine's default rule gives the Mac's memory (its cap: half of it), and an SSD read
rate from a published figure (docs/plan.md names each source). Compute and the engine's per-call
costs are left out (0 ms): each figure is an upper bound set by the SSD.

    python bench/plan_macs.py [--tokens 16]
"""

from __future__ import annotations

import argparse

from manifest_load import synthetic_k3

from cachecd.plan.plan import Inputs, project_row
from cachecd.plan.routing import flat
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16, help="flat-routing tokens counted")
    args = ap.parse_args()
    m = synthetic_k3()
    work = flat(m, 16, args.tokens)
    print("| Mac | memory | pool (default) | pool hits | SSDs | SSD read | tok/s (upper bound) |")
    print("|---|---|---|---|---|---|---|")
    for name, mem, rate in MACS:
        total = mem * GIB
        pool = total // 2  # the default's cap (POOL_CAP_SHARE) when the resident model leaves room
        for n in SSDS:
            machine = Machine(total, total, None, n * rate * GB, n * rate * GB, None, None)
            row = project_row(Inputs(m, machine, 0.0, pool, slot_bytes(m)), work, pool,
                              m.expert_bytes_total, seed=0)
            print(f"| {name} | {mem} GB | {pool / GIB:.0f} GiB | {row['pool_hit_rate']:.1%} | "
                  f"{n} | {n * rate:.1f} GB/s | {row['tok_s_cold']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
