"""`cachecd plan --prompt-tokens N` against a run: project a prompt's first token, then prefill it.

For each model (``--models``: ``tiny``, the tiny K3 with 6.5 KB experts; ``k3``, a K3-shaped
slice whose experts are K3's real 17,547,264 bytes), a checkpoint is served by ``cachecd hub
serve``, installed with ``cachecd setup --stream`` and every expert cached on disk. For each
pool (one smaller than a layer's routed experts, one that holds a layer's):

  projected: ``cachecd.plan.prompt`` for a prompt of ``--tokens`` at ``--step``: its reads (flat
             routing through the pool), ``cachecd doctor``'s rates on the cache dir and the
             engine probe's costs, and the compute: the resident model's prefill of the same
             prompt, measured here (``--compute resident``, what ``plan --prefill-ms`` takes),
             or the plan's probe (``--compute probe``);
  measured:  the time to the first token through the daemon (mlx-lm's ``generate_step``, which
             the engine prefills layer by layer), a fresh pool each time: warm (the blobs in
             the page cache) and cold (every blob dropped from the page cache first), and the
             experts it read.

Prints projected and measured side by side with measured/projected; a projection off by more
than 25% is a bug in the plan's model. The last line is ``ratio=`` the worst time's.

    python bench/prompt_check.py [--models tiny,k3] [--tokens 512] [--step 64] [--rounds 2]
        [--dtype float32|bfloat16] [--compute resident|probe] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from _common import K3_SHAPE, installed, median, paired_ratio, served_checkpoint, warm_disk
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from plan_check import _vocab, drop_page_cache

MODELS: dict[str, dict[str, Any]] = {
    # name: checkpoint options, pools (slots) below and at a layer's routed experts, top-k
    "tiny": {"opts": dict(experts=32, layers=6, top_k=4), "slots": (12, 32), "top_k": 4,
             "doctor": 16 << 20},
    "k3": {"opts": dict(experts=32, layers=6, top_k=16, shard_bytes=4_000_000_000, **K3_SHAPE),
           "slots": (20, 32), "top_k": 16, "doctor": 1 << 30},
}


def first_token_s(model: Any, prompt: list[int], step: int, before: Any = None) -> float:
    """Seconds from the call to mlx-lm's loop to its first token."""
    if before is not None:
        before()
    t0 = time.perf_counter()
    token, _ = next(generate_step(mx.array(prompt), model, max_tokens=1, prefill_step_size=step,
                                  prompt_cache=make_prompt_cache(model)))
    return time.perf_counter() - t0


def streamed(served: Any, sock: Path, slots: int, dtype: Any) -> Any:
    from cachecd.plan.simulate import slot_bytes
    from cachecd_engine.run import load

    model, _ = load(served.repo, sock, ram_bytes=slots * slot_bytes(served.manifest),
                    prefetch=False, speculate=False)
    model.set_dtype(dtype)
    return model


def measure(served: Any, sock: Path, cache_dir: Path, slots: int, prompt: list[int],
            args: Any) -> dict[str, Any]:
    """Per round, back to back (a shared machine's slow stretch hits all three): the resident
    model's first token, then the streamed model's warm and cold, each with a fresh pool."""
    dtype = getattr(mx, args.dtype)
    resident, _ = load_model(served.repo_dir)
    resident.set_dtype(dtype)
    got: dict[str, Any] = {"resident": [], "warm": [], "cold": [], "reads": []}
    for r in range(args.rounds + 1):  # round 0 warms up and is not counted
        res = first_token_s(resident, prompt, args.step)
        times = {}
        for case, before in (("warm", None), ("cold", lambda: drop_page_cache(cache_dir))):
            model = streamed(served, sock, slots, dtype)
            got["slots"] = model.bank.capacity
            assert model.deferral.on, "the engine would prefill step by step"
            times[case] = first_token_s(model, prompt, args.step, before)
            reads = model.bank.stats.source_hits
            model.bank.close()
            model.bank.source.close()
        if r:
            got["resident"].append(res)
            got["reads"].append(reads)
            for case, took in times.items():
                got[case].append(took)
    return got


def check(name: str, args: Any) -> list[tuple[str, float, float]]:
    from cachecd.plan.doctor import measure as doctor
    from cachecd.plan.probe import engine_costs
    from cachecd.plan.prompt import prefill_compute_s, project, prompt_reads
    from cachecd.plan.speed import Calls, Machine

    spec, out = MODELS[name], []
    with served_checkpoint(args.dir, f"bench/prompt-{name}", **spec["opts"]) as served:
        m = served.manifest
        prompt = np.random.default_rng(7).integers(0, _vocab(served.repo_dir),
                                                   size=args.tokens).tolist()
        with installed(served) as (sock, cache_dir):
            warm_disk(sock, served)
            costs = engine_costs(m, spec["top_k"], args.dtype, socket=str(sock),
                                 cache_dirs=[str(cache_dir)])
            machine = Machine.from_doctor(doctor([str(cache_dir)], spec["doctor"],
                                                 int(m.sizes[0]), socket=str(sock)))
            calls = Calls(call_s=costs.call_s, miss_call_s=costs.miss_call_s(machine.page_rate),
                          request_experts=costs.request_experts,
                          cold_rate=costs.cold_rate(machine.page_rate))
            probe = prefill_compute_s(m, spec["top_k"], args.tokens, args.step, args.dtype)
            print(f"{name}: {len(m.moe_layers)} MoE layers x {m.experts_per_layer} experts of "
                  f"{int(m.sizes[0])} B, top-{spec['top_k']}, prompt {args.tokens} tokens at "
                  f"step {args.step}, {args.dtype}, backend {mx.default_device()}; compute: "
                  f"{args.compute} (the probe's: {probe:.3f} s); engine {calls.call_s * 1e3:.2f}"
                  f" ms a call, {calls.miss_call_s * 1e3:.2f} ms more with misses; page cache "
                  f"{machine.page_rate / 1e9:.2f} GB/s, cold {machine.cold_rate / 1e9:.2f} GB/s",
                  flush=True)
            for slots in spec["slots"]:
                got = measure(served, sock, cache_dir, slots, prompt, args)
                reads = prompt_reads(m, spec["top_k"], args.tokens, args.step, got["slots"])
                pool = got["slots"] * int(m.sizes[0])

                def projected(compute: float, cold: bool, reads: Any = reads,
                              pool: int = pool) -> float:
                    # Cold: nothing of the disk cache in the page cache.
                    mach = replace(machine, available=0) if cold else machine
                    t = project(m, mach, reads, compute, calls, pool, args.tokens)
                    return float(t["first_token_s"]["warm"])

                computes = got["resident"] if args.compute == "resident" else \
                    [probe] * args.rounds
                print(f"  pool {got['slots']} slots ({'holds' if reads.fits else 'less than'} a "
                      f"layer's {max(reads.routed):.1f} routed experts; {reads.calls:.0f} calls, "
                      f"{reads.miss_calls:.0f} reading); resident first token "
                      f"{median(got['resident']):.3f} s")
                print(f"    {'reads':20s} projected {reads.reads:9.1f}  measured "
                      f"{median(got['reads']):9.1f}  measured/projected "
                      f"{median(got['reads']) / reads.reads:.3f}")
                for case in ("warm", "cold"):
                    proj = [projected(c, case == "cold") for c in computes]
                    ratio = paired_ratio(got[case], proj)
                    print(f"    first token {case} s  projected {median(proj):9.4f}  measured "
                          f"{median(got[case]):9.4f}  measured/projected {ratio:.3f} (median "
                          f"of the rounds' ratios)", flush=True)
                    out.append((f"{name} {got['slots']} slots first token {case}", 1.0, ratio))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp", help="where the work dir (removed at the end) goes")
    ap.add_argument("--models", default="tiny,k3", help="which models, comma-separated")
    ap.add_argument("--tokens", type=int, default=512, help="the prompt's tokens")
    ap.add_argument("--step", type=int, default=64, help="prefill_step_size")
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds (after a warm-up)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--compute", default="resident", choices=["resident", "probe"])
    args = ap.parse_args(argv)
    out = []
    for name in [n for n in args.models.split(",") if n]:
        out += check(name, args)
    worst = max(out, key=lambda r: abs(np.log(r[2] / r[1])))
    print(f"worst: {worst[0]} measured/projected {worst[2] / worst[1]:.3f}")
    print(f"ratio={worst[2] / worst[1]:.3f}")


if __name__ == "__main__":
    main()
