"""Every figure of docs/k3.md ("Run Kimi K3"): `cachecd plan`'s own functions on a K3-shaped
manifest built here, since the Hub (and so `cachecd plan --model moonshotai/Kimi-K3`) is not
reachable from the project's machine.

The manifest is ``manifest_load.synthetic_k3``: DESIGN.md's K3 facts (92 MoE layers x 896 experts
of 17,547,264 bytes, top-16, 96 shards), its resident tensors placeholders. K3's resident size is
not in those facts: it is estimated from the published total (2.8T parameters, rounded to 0.1T)
less the routed experts' parameters, and the page says so; ``--resident-gb`` changes it.

Per pool size: the memory it needs beside the resident model, its hit rate on flat routing and on
decode traces with K3's published statistics (``cycle_traces.K3``), replayed through the engine's
slot table (``plan.simulate``), a decode token's upper bound off one SSD, and the first token of a
``--prompt-tokens`` prompt cold from the Hub, warm from the disk cache, and from the pool
(``plan.prompt``). Compute and the engine's per-call costs are left out (0): each time is a lower
bound set by the bytes. Per disk budget: the disk's hit rate and the decode bound.

    python bench/k3_page.py [--ssd-gbs 13.6] [--hub-gbits 1] [--resident-gb 155]
                            [--prompt-tokens 512] [--tokens 16] [--k3-tokens 120]
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from cycle_traces import K3, generate
from manifest_load import synthetic_k3

from cachecd.manifest.step_need import DEFAULT_PREFILL_STEP, step_need
from cachecd.plan.plan import Inputs, PromptArgs, project_prompt, project_row
from cachecd.plan.routing import Workload, flat
from cachecd.plan.simulate import pool_slots, slot_bytes
from cachecd.plan.speed import Machine
from cachecd.sizes import format_size

GB, GIB = 10**9, 1 << 30
PUBLISHED_PARAMS = 2.8e12  # DESIGN.md: "Kimi K3 (2.8T MoE ...)", rounded to 0.1T
POOLS_GIB = (8, 16, 32, 64, 128)
BUDGET_SHARES = (0.0109, 0.05, 0.25, 0.5, 1.0)


def k3_statistics(manifest: Any, tokens: int, seed: int = 0) -> Workload:
    trace = generate(dataclasses.replace(K3, tokens=tokens, seed=seed))
    layers = manifest.moe_layers
    calls = [(int(layers[m]), ids, True) for m, ids, _ in trace.calls()]
    return Workload(calls, tokens, f"K3 statistics, seed {seed}, {tokens} tokens", 16)


def facts(m: Any) -> float:
    """The model's sizes, and the resident part's parameters estimated from the published
    total (returned)."""
    layers, per = len(m.moe_layers), m.experts_per_layer
    # An expert's parameters from its shapes (DESIGN.md): w1, w3 [3072, 3584] and w2 [3584, 3072]
    # unpacked (mxfp4 packs two to a byte).
    expert_params = 3 * 3072 * 3584
    routed = layers * per * expert_params
    need = step_need(m, 16, DEFAULT_PREFILL_STEP)
    print(f"MoE layers {layers}, experts a layer {per}, routed experts {layers * per:,}")
    print(f"expert bytes {m.expert_bytes_total / (layers * per):,.0f}; all routed experts "
          f"{m.expert_bytes_total:,} B ({m.expert_bytes_total / 1e12:.3f} TB); shards "
          f"{len(m.shards)}")
    print(f"routed a token (top-16): {16 * layers * m.expert_bytes_total / (layers * per) / GB:.2f}"
          f" GB; the smallest working disk budget (one layer's prefill step of "
          f"{need.step} tokens): {format_size(need.nbytes)} ({need.nbytes / GB:.1f} GB)")
    resident = PUBLISHED_PARAMS - routed
    low, high = resident - 0.05e12, resident + 0.05e12
    print(f"routed parameters {routed / 1e12:.4f}T; resident = 2.8T - that = {resident / 1e9:.0f}B "
          f"parameters ({low / 1e9:.0f}-{high / 1e9:.0f}B for 2.75-2.85T), "
          f"{2 * resident / GB:.0f} GB in bf16 ({2 * low / GB:.0f}-{2 * high / GB:.0f} GB)")
    return resident


def machine(memory: int, ssd: float, hub: float, resolve_s: float) -> Machine:
    return Machine(memory, memory, None, ssd, ssd, hub, resolve_s)


def pool_table(m: Any, works: dict[str, Workload], args: argparse.Namespace,
               resident: int) -> None:
    ssd, hub = args.ssd_gbs * GB, args.hub_gbits * GB / 8
    print(f"\npools (budget: every expert on disk; SSD {args.ssd_gbs} GB/s; Hub {args.hub_gbits} "
          f"Gbit/s; prompt {args.prompt_tokens} tokens, step 2048; compute left out)")
    print("| pool | slots | memory: resident + pool | pool hits: flat / K3 statistics | decode "
          "tok/s bound: flat / K3 statistics | first token: cold (Hub) / warm (disk) / pool |")
    print("|---|---|---|---|---|---|")
    for gib in POOLS_GIB:
        pool = gib * GIB
        mach = machine(resident + pool + 8 * GIB, ssd, hub, args.resolve_s)
        inp = Inputs(m, mach, 0.0, pool, slot_bytes(m))
        rows = {k: project_row(inp, w, pool, m.expert_bytes_total, seed=0)
                for k, w in works.items()}
        first = project_prompt(inp, 16, PromptArgs(args.prompt_tokens, 2048, 0.0), pool,
                               "bfloat16")["first_token_s"]
        slots = pool_slots(pool, slot_bytes(m), 16, m.n_experts)
        f, k = rows["flat"], rows["k3"]
        print(f"| {gib} GiB | {slots} | {(resident + pool) / GB:.0f} GB | "
              f"{f['pool_hit_rate']:.1%} / {k['pool_hit_rate']:.1%} | "
              f"{f['tok_s_cold']:.2f} / {k['tok_s_cold']:.2f} | "
              f"{first['cold']:,.0f} s / {first['warm']:,.0f} s / {first['pool']:,.0f} s |",
              flush=True)


def budget_table(m: Any, works: dict[str, Workload], args: argparse.Namespace,
                 resident: int) -> None:
    pool = 32 * GIB
    ssd, hub = args.ssd_gbs * GB, args.hub_gbits * GB / 8
    mach = machine(resident + pool + 8 * GIB, ssd, hub, args.resolve_s)
    inp = Inputs(m, mach, 0.0, pool, slot_bytes(m))
    print("\ndisk budgets (pool 32 GiB; K3 statistics; disk warmed first, as `cachecd plan` "
          "does)")
    print("| budget | disk hits of the pool's misses | from the Hub a token | decode tok/s bound |")
    print("|---|---|---|---|")
    for share in BUDGET_SHARES:
        budget = int(m.expert_bytes_total * share)
        r = project_row(inp, works["k3"], pool, budget, seed=0)
        print(f"| {budget / GB:,.0f} GB | {r['disk_hit_rate']:.1%} | "
              f"{r['hub_bytes_per_token'] / GB:.2f} GB | {r['tok_s_cold']:.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ssd-gbs", type=float, default=13.6, help="SSD reads, GB/s (M5 Max)")
    ap.add_argument("--hub-gbits", type=float, default=1.0, help="the Hub's range rate, Gbit/s")
    ap.add_argument("--resolve-s", type=float, default=0.5, help="one resolve, seconds")
    ap.add_argument("--resident-gb", type=float, help="the resident model's bytes, GB "
                    "(default: the estimate from the published total, in bf16)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16, help="flat-routing tokens counted")
    ap.add_argument("--k3-tokens", type=int, default=120, help="K3-statistics trace tokens")
    args = ap.parse_args()
    m = synthetic_k3()
    params = facts(m)
    resident = int(args.resident_gb * GB) if args.resident_gb else int(2 * params)
    print(f"resident model taken as {resident / GB:.0f} GB")
    works = {"flat": flat(m, 16, args.tokens), "k3": k3_statistics(m, args.k3_tokens)}
    pool_table(m, works, args, resident)
    budget_table(m, works, args, resident)


if __name__ == "__main__":
    main()
