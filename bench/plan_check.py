"""`cachecd plan`'s projection against a run: project, then decode, on this machine.

For each model (``--models``: ``tiny``, the tiny K3 with 6.5 KB experts; ``k3``, a K3-shaped
slice whose experts are K3's real 17,547,264 bytes), a checkpoint is served by ``cachecd hub
serve``, installed with ``cachecd setup --stream`` and every expert cached on disk. Then:

  projected: ``cachecd doctor`` on the cache dir (cold reads at each queue depth, the page
             cache), the plan's replay of flat routing through the engine's slot table with the
             run's pool, and the compute per token: the resident model's token, measured here
             (``--compute resident``, what ``plan --compute-ms`` takes), or the plan's one-layer
             probe (``--compute probe``);
  measured:  greedy decode through the daemon with that pool (read-ahead and speculative steps
             off, the CPU's defaults): warm (the blobs in the page cache) and cold (every blob
             dropped from the page cache with ``posix_fadvise(DONTNEED)`` before each token).

Prints projected and measured tok/s and pool hit rates side by side, and the measured/projected
ratio of each; a projection off by more than 25% is a bug in the plan's model. The last line is
``ratio=`` the worst of them (the one farthest from 1).

``--as-user``: the commands as a user runs them, side by side, nothing given to the plan but a
doctor's JSON of the cache dir: each round ``cachecd run --max-tokens 64 --json`` (its
``generation_tps``) then ``cachecd plan --json`` (its row for the whole model on disk, warm: the
run's setting), after one untimed run that puts the routed experts on disk. The plan's compute
is its own probe (the model built from its config.json), its top-k the config's. Models:
``tiny``, and ``wide`` (a tiny K3 routing 6 experts a token whose 32,768-token head costs more
than its routed experts, as tests/functional/test_plan_user.py uses).

    python bench/plan_check.py [--models tiny,k3] [--tokens 6] [--rounds 2]
        [--dtype float32|bfloat16] [--compute resident|probe] [--dir /tmp]
    python bench/plan_check.py --as-user [--models tiny,wide] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from _common import K3_SHAPE, installed, median, served_checkpoint, warm_disk
from mlx_lm.utils import load_model

MODELS: dict[str, dict[str, Any]] = {
    # name: checkpoint options, the run's pool (smaller than the experts: misses every token)
    "tiny": {"opts": dict(experts=32, layers=6, top_k=4), "pool": 96 << 10, "top_k": 4,
             "doctor": 16 << 20},
    "k3": {"opts": dict(experts=32, layers=6, top_k=16, shard_bytes=4_000_000_000, **K3_SHAPE),
           "pool": 1 << 30, "top_k": 16, "doctor": 1 << 30},
}


@dataclass
class Measured:
    warm_s: list[float]
    cold_s: list[float]
    pool_hits: float
    resident_s: float
    slots: int  # the run's pool


def drop_page_cache(cache_dir: Path) -> None:
    """Every blob's clean pages out of the page cache (they were written and synced long ago)."""
    for path in (cache_dir / "blobs").rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def decode_tokens(model: Any, prompt: list[int], n: int, before: Any = None) -> list[float]:
    """Seconds of each of ``n`` greedy decode steps after ``prompt``; ``before()`` runs, untimed,
    before each step."""
    cache = model.make_cache()
    logits = model(mx.array(prompt)[None], cache=cache)
    mx.eval(logits)
    if getattr(model, "bank", None) is not None:
        model.bank.stats.reset()  # count the decode steps only
    times = []
    for _ in range(n):
        tok = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(tok)
        if before is not None:
            before()
        t0 = time.perf_counter()
        logits = model(tok[:, None], cache=cache)
        mx.eval(logits)
        times.append(time.perf_counter() - t0)
    return times


def measure(served: Any, sock: Path, cache_dir: Path, pool: int, args: Any) -> Measured:
    from cachecd_engine.run import load

    dtype = getattr(mx, args.dtype)
    vocab = int(served.manifest_vocab)
    rng = np.random.default_rng(7)
    resident, _ = load_model(served.repo_dir)
    resident.set_dtype(dtype)
    model, _ = load(served.repo, sock, ram_bytes=pool, prefetch=False, speculate=False,
                    trace=served.work / "run.trace")
    model.set_dtype(dtype)
    warm, cold, res = [], [], []
    hits = routed = 0.0
    for r in range(args.rounds + 1):  # round 0 warms up and is not counted
        prompt = rng.integers(0, vocab, size=4).tolist()
        rt = decode_tokens(resident, prompt, args.tokens)
        wt = decode_tokens(model, prompt, args.tokens)
        s = model.bank.stats.snapshot()
        ct = decode_tokens(model, prompt, args.tokens, lambda: drop_page_cache(cache_dir))
        if r:
            print("  warm per token (ms): " + ", ".join(
                f"{k} {s[k] * 1e3 / args.tokens:.2f}" for k in ("readback_s", "wait_s", "plan_s"))
                + f"; layer calls {s.get('layer_calls', 0) / args.tokens:.1f}, read "
                f"{s['source_hits'] / args.tokens:.1f} experts", flush=True)
            res += rt
            warm += wt
            cold += ct
            hits += s["ram_hits"]
            routed += s["experts_routed"]
        print(f"round={r} resident={args.tokens / sum(rt):.3f} warm={args.tokens / sum(wt):.3f} "
              f"cold={args.tokens / sum(ct):.3f} tok/s", flush=True)
    slots = model.bank.capacity
    model.bank.trace.close()  # its last step is written out
    model.bank.close()
    model.bank.source.close()
    return Measured(warm, cold, hits / routed if routed else 0.0, median(res), slots)


def replayed_hits(served: Any, slots: int, args: Any) -> float:
    """The plan's replay of the run's own trace through its pool (``simulate.through_pool``),
    once from an empty pool as the engine ran it, counted over the calls the run counted: the
    warm decode steps of the measured rounds. Equal to the measured rate where the replay
    drives the slot table as the engine does."""
    from cachecd.plan.simulate import through_pool
    from cachecd_engine.pool.slots import SlotTable
    from cachecd_engine.trace import read_calls

    layers = len(served.manifest.moe_layers)
    per_round = 2 * (1 + args.tokens) * layers  # warm: prefill, tokens; cold: the same
    table, hits, asked = SlotTable(slots), 0, 0
    for i, (layer, rows) in enumerate(read_calls(served.work / "run.trace")):
        ids = rows.reshape(-1).tolist()
        held = through_pool(table, layer, ids)[1]
        r, j = divmod(i, per_round)
        if r and layers <= j < layers * (1 + args.tokens):
            hits, asked = hits + len(held), asked + len(set(ids))
    return hits / asked if asked else 0.0


def project(served: Any, sock: Path, cache_dir: Path, pool: int, top_k: int, compute_s: float,
            costs: Any, size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plan's row for this pool and the whole model on disk: with flat routing (what a
    user without traces gets) and with the run's own trace (the simulation checked alone)."""
    from cachecd.plan.doctor import measure as doctor
    from cachecd.plan.plan import Inputs, project_row
    from cachecd.plan.routing import flat, from_traces
    from cachecd.plan.simulate import slot_bytes
    from cachecd.plan.speed import Calls, Machine

    m = served.manifest
    report = doctor([str(cache_dir)], size, int(m.sizes[0]), socket=str(sock))
    machine = Machine.from_doctor(report)
    calls = Calls(call_s=costs.call_s, miss_call_s=costs.miss_call_s(machine.page_rate),
                  request_experts=costs.request_experts,
                  cold_rate=costs.cold_rate(machine.page_rate))
    how = (f"read through the daemon, its round trip in it ({costs.request_experts} experts)"
           if costs.request_experts else "from a local file, plus the doctor's round trip")
    cold = (f"{calls.cold_rate / 1e9:.3f} GB/s off the disk as the engine reads a call's misses"
            if calls.cold_rate else "not measured by the engine probe")
    print(f"  doctor: cold {machine.cold_rate / 1e9:.2f} GB/s at the client's queue depth "
          f"({', '.join(f'QD{q} {r / 1e9:.2f}' for q, r in machine.cold_by_depth)}), page "
          f"cache {machine.page_rate / 1e9:.2f} GB/s, daemon round trip back to back "
          f"{machine.request_s * 1e3:.2f} ms; engine: {calls.call_s * 1e3:.2f} ms a call, "
          f"{calls.miss_call_s * 1e3:.2f} ms more with misses beyond their bytes ({how}); "
          f"cold: {cold}", flush=True)
    inputs = Inputs(m, machine, compute_s, pool, slot_bytes(m), calls)
    rows = [project_row(inputs, work, pool, m.expert_bytes_total, seed=0)
            for work in (flat(m, top_k, 64), from_traces(m, [str(served.work / "run.trace")]))]
    return rows[0], rows[1]


def check(name: str, args: Any) -> list[tuple[str, float, float]]:
    spec = MODELS[name]
    with served_checkpoint(args.dir, f"bench/plan-{name}", **spec["opts"]) as served:
        served.manifest_vocab = _vocab(served.repo_dir)
        with installed(served) as (sock, cache_dir):
            warm_disk(sock, served)
            got = measure(served, sock, cache_dir, spec["pool"], args)
            from cachecd.plan.probe import engine_costs

            costs = engine_costs(served.manifest, spec["top_k"], args.dtype, socket=str(sock),
                                 cache_dirs=[str(cache_dir)])
            if args.compute == "resident":
                compute_s, how = got.resident_s, "the resident model's token, measured"
            else:
                compute_s = costs.compute_s * len(served.manifest.moe_layers)
                how = "the plan's one-layer probe"
            row, traced = project(served, sock, cache_dir, spec["pool"], spec["top_k"],
                                  compute_s, costs, spec["doctor"])
            same = replayed_hits(served, got.slots, args)
    warm, cold = 1 / median(got.warm_s), 1 / median(got.cold_s)
    m = served.manifest
    print(f"{name}: {len(m.moe_layers)} MoE layers x {m.experts_per_layer} experts of "
          f"{int(m.sizes[0])} B, top-{spec['top_k']}, pool {spec['pool']} B ({row['slots']} "
          f"slots), activations {args.dtype}, {args.tokens} tokens x {args.rounds} rounds, "
          f"backend {mx.default_device()}; compute {compute_s * 1e3:.1f} ms a token ({how}); "
          f"resident token measured {got.resident_s * 1e3:.1f} ms")
    rows = [("pool hit rate", row["pool_hit_rate"], got.pool_hits),
            ("tok/s warm", row["tok_s_warm"], warm), ("tok/s cold", row["tok_s_cold"], cold)]
    print(f"  flat routing (the plan without a trace); from the run's own trace (plan --trace, "
          f"its second pass): pool hit rate {traced['pool_hit_rate']:.4f}, tok/s warm "
          f"{traced['tok_s_warm']:.4f}, cold {traced['tok_s_cold']:.4f}; the trace replayed "
          f"once, the measured calls counted: pool hit rate {same:.4f}")
    for what, p, g in rows:
        print(f"  {what:14s} projected {p:9.4f}  measured {g:9.4f}  measured/projected "
              f"{g / p if p else float('nan'):.3f}")
    return [(f"{name} {w}", p, g) for w, p, g in rows[1:]]


def _vocab(repo_dir: Path) -> int:
    import json

    config = json.loads((repo_dir / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


USER_MODELS: dict[str, dict[str, Any]] = {
    "tiny": {}, "wide": dict(top_k=6, vocab_size=32768, hidden=256),
    "k3": dict(experts=32, layers=6, top_k=16, shard_bytes=4_000_000_000, **K3_SHAPE),
}


def as_user(name: str, args: Any) -> list[tuple[str, float, float]]:
    """``cachecd run`` and ``cachecd plan`` in turn, as a user runs them (see the docstring)."""
    import json

    from cachecd.plan.doctor import measure as doctor
    from tests.harness import run_cli

    def cli(*a: str) -> dict[str, Any]:
        return dict(json.loads(run_cli(*a, "--json", timeout=1800).stdout))

    with served_checkpoint(args.dir, f"bench/user-{name}", **USER_MODELS[name]) as served:
        with installed(served) as (sock, cache_dir):
            report = served.work / "doctor.json"
            report.write_text(json.dumps(doctor([str(cache_dir)], 16 << 20, 64 << 10,
                                                socket=str(sock))))
            run = ("run", "--model", served.repo, "--socket", str(sock), "--prompt",
                   "Hello there", "--max-tokens", "64")
            cli(*run)  # untimed: the experts it routes to go on disk
            runs, plans = [], []
            for r in range(args.rounds):
                runs.append(float(cli(*run)["generation_tps"]))
                plan = cli("plan", "--model", served.repo, "--socket", str(sock), "--doctor",
                           str(report))
                plans.append(float(plan["budgets"][-1]["tok_s_warm"]))
                print(f"  round={r} run={runs[-1]:.2f} tok/s plan={plans[-1]:.2f} tok/s "
                      f"(compute {plan['compute']['ms_per_token']:.1f} ms, top-"
                      f"{plan['model']['top_k']} from {plan['model']['top_k_source']})",
                      flush=True)
    ratio = median(runs) / median(plans)
    print(f"{name}: cachecd run {median(runs):.2f} tok/s, cachecd plan {median(plans):.2f} "
          f"tok/s (medians of {args.rounds}); run/plan {ratio:.3f}; compute source: "
          f"{plan['compute']['source']}")
    return [(f"{name} as a user", median(plans), median(runs))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp", help="where the work dir (removed at the end) goes")
    ap.add_argument("--models", default="tiny,k3", help="which models, comma-separated")
    ap.add_argument("--tokens", type=int, default=6, help="decode steps a round and case")
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds (after a warm-up)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--compute", default="resident", choices=["resident", "probe"])
    ap.add_argument("--as-user", action="store_true",
                    help="cachecd plan and cachecd run side by side, as a user runs them")
    args = ap.parse_args(argv)
    out = []
    if args.as_user and args.models == ap.get_default("models"):
        args.models = "tiny,wide"
    for name in [n for n in args.models.split(",") if n]:
        out += as_user(name, args) if args.as_user else check(name, args)
    worst = max(out, key=lambda r: abs(np.log(r[2] / r[1])) if r[1] else 0.0)
    print(f"worst: {worst[0]} measured/projected {worst[2] / worst[1]:.3f}")
    print(f"ratio={worst[2] / worst[1]:.3f}")


if __name__ == "__main__":
    main()
