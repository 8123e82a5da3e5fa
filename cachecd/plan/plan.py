"""``cachecd plan``: how fast a model will run here, with how much disk, before downloading it.

From the manifest (bytes per expert per layer), the workload (traces, or flat routing), the
doctor's figures (``--doctor FILE``, or measured now) and the compute per token (``probe``, or
``--compute-ms``): hit rates against disk budget and pool size (``simulate``: the engine's slot
table and the store's policy), tok/s cold and warm (``speed``), the first cold token's time from
the Hub, and a recommended budget and pool. The pool recommended is the engine's default for
the doctor's figures (``cachecd_engine.pool.memory.pool_bytes_for``): what ``cachecd run`` takes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cachecd import constants
from cachecd.cli_help import count, number
from cachecd.config import parse_size
from cachecd.errors import InvalidRequest
from cachecd.manifest.manifest import Manifest

log = logging.getLogger(__name__)

PLAN_FORMAT = "cachecd-plan"
BUDGET_SHARES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)  # of the experts' bytes
POOL_SHARES = (0.25, 0.5, 1.0, 2.0)  # of the recommended pool
GOOD_ENOUGH = 0.95  # the recommended budget: the least that reaches this share of the best
FLAT_TOKENS = 64  # cachecd run's --max-tokens default
PREFILL_STEP = 2048  # mlx-lm's prefill_step_size


def register(sub: Any) -> None:
    p = sub.add_parser("plan", help="project tok/s and the disk a model needs on this machine")
    p.add_argument("--model",
                   help="a manifest file, a repo whose manifest cachecd ships, a repo the "
                        "running daemon serves, or any Hub repo ORG/NAME[@REV] (planned from "
                        "its config.json and its shards' headers: nothing else downloaded); "
                        "default: the one model the daemon has registered")
    p.add_argument("--endpoint", help="the Hub for a model not installed (default: the "
                   "configured one)")
    p.add_argument("--trace", action="append", metavar="FILE",
                   help="routing traces (cachecd run --trace), repeatable (default: flat routing)")
    p.add_argument("--budget", help="a disk budget to project too, e.g. 500GB (default: "
                   "shares of the model's experts from 1%% to all)")
    p.add_argument("--pool", help="a pool size to project too (default: the engine's default)")
    p.add_argument("--doctor", metavar="FILE",
                   help="a doctor's figures (cachecd doctor --json > FILE); default: measure now")
    p.add_argument("--cache-dir", help="the cache dir to measure, or to read from --doctor "
                   f"(default: the doctor's first; measured: {constants.DEFAULT_CACHE_DIR})")
    p.add_argument("--compute-ms", type=number(0),
                   help="compute per token in ms (default: measured: a decode token of the "
                        "model built from its config.json, random weights, this machine)")
    p.add_argument("--call-ms", type=number(0), nargs=2, metavar=("CALL", "MISS"),
                   help="the engine's own ms per MoE layer call, and what a call with misses "
                        "adds (default: measured with the engine's streamed layer)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="the probes' dtype (default: the checkpoint's, as cachecd run computes)")
    p.add_argument("--top-k", type=count(1), help="experts routed per token per layer (default: "
                   "the traces', else the model's config.json's)")
    p.add_argument("--tokens", type=count(1), default=FLAT_TOKENS,
                   help="tokens a run generates, from a fresh pool, under flat routing "
                        "(default %(default)s, as cachecd run --max-tokens)")
    p.add_argument("--prompt-tokens", type=count(1), metavar="N",
                   help="project the time to the first token of a prompt of N tokens, "
                        "prefilled layer by layer (cold, warm, from the pool); default: none, no prompt projected")
    p.add_argument("--prefill-step-size", type=count(1), default=PREFILL_STEP,
                   help="prompt tokens per prefill step (default %(default)s, as cachecd run)")
    p.add_argument("--prefill-ms", type=number(0),
                   help="the prompt's compute in ms (default: the probe's routed experts "
                        "for one step's rows, scaled by the prompt's tokens)")
    p.add_argument("--socket", help="the daemon's socket, for a model it serves (default: "
                   "CACHECD_SOCKET or the config's)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--png", metavar="FILE", help="write the curve of tok/s against budget "
                   "(default: none)")
    p.set_defaults(func=plan_command)


def plan_command(args: argparse.Namespace) -> int:
    from cachecd.plan import model_source
    from cachecd.plan.render import render_png, render_table
    from cachecd_client import resolve_model

    say = Progress()
    args.model = resolve_model(args.model, args.socket)
    need = args.compute_ms is None or (args.top_k is None and not args.trace)
    say(f"reading {args.model}'s manifest and config.json")
    model = model_source.load(args.model, args.socket, args.endpoint, need_config=need)
    if not args.doctor:
        say("measuring the disk, memory and daemon as cachecd doctor does (--doctor FILE "
            "reuses its figures)")
    doctor = _doctor(args)
    result = build_plan(
        model.manifest, doctor, traces=args.trace or [], top_k=args.top_k, tokens=args.tokens,
        compute_ms=args.compute_ms, call_ms=args.call_ms, dtype=args.dtype,
        cache_dir=args.cache_dir,
        budgets=[parse_size(args.budget, "--budget")] if args.budget else [],
        pools=[parse_size(args.pool, "--pool")] if args.pool else [],
        prompt=PromptArgs(args.prompt_tokens, args.prefill_step_size, args.prefill_ms)
        if args.prompt_tokens else None, config=model.config, say=say)
    say("done")
    result["model"].update(model.describe())
    if args.png:
        Path(args.png).write_bytes(render_png(result))
    print(json.dumps(result, indent=1) if args.json else render_table(result))
    return 0


def _doctor(args: argparse.Namespace) -> dict[str, Any]:
    from cachecd.plan import doctor

    if args.doctor:
        return doctor.load_report(args.doctor)
    return doctor.measure([args.cache_dir or str(constants.DEFAULT_CACHE_DIR)],
                          parse_size(doctor.DEFAULT_SIZE), doctor._block_default(),
                          socket=args.socket)


class Progress:
    """The plan's long steps on stderr as they start, with the seconds so far: a plan measures
    the disk and the compute and simulates every budget, a minute or more in silence else."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, step: str) -> None:
        print(f"plan: {time.perf_counter() - self.t0:5.1f} s: {step}", file=sys.stderr,
              flush=True)


def _quiet(step: str) -> None:
    pass


@dataclass
class PromptArgs:
    tokens: int
    step: int = PREFILL_STEP
    compute_ms: float | None = None  # given; None: the probe's


@dataclass
class Inputs:
    manifest: Manifest
    machine: Any  # speed.Machine
    compute_s: float
    pool_bytes: int
    slot_bytes: int
    costs: Any = None  # speed.Calls: the engine's costs per call (its counts are the replay's)


def build_plan(manifest: Manifest, doctor: dict[str, Any], *, traces: list[str],
               top_k: int | None = None, tokens: int = FLAT_TOKENS,
               compute_ms: float | None = None, call_ms: list[float] | None = None,
               dtype: str | None = None,
               cache_dir: str | None = None, budgets: list[int] | None = None,
               pools: list[int] | None = None, seed: int = 0,
               prompt: PromptArgs | None = None,
               config: dict[str, Any] | None = None,
               say: Callable[[str], None] = _quiet) -> dict[str, Any]:
    """``config``: the model's config.json, where known: its top-k, and the compute of a whole
    token (``token_probe``); without it the compute is the routed experts' (``probe``).
    ``say``: told each long step as it starts."""
    from cachecd.plan.simulate import slot_bytes
    from cachecd.plan.speed import Machine, first_token_s
    from cachecd.plan.token_probe import checkpoint_dtype
    t0 = time.perf_counter()
    machine = Machine.from_doctor(doctor, cache_dir)
    work, top_k_src = _workload(manifest, traces, top_k, tokens, seed, config)
    top_k = top_k or work.top_k
    dtype = dtype or checkpoint_dtype(config or {}, manifest)
    socket = (doctor.get("daemon") or {}).get("socket")  # the daemon the doctor reached
    dirs = [d["path"] for d in doctor["disks"]]
    if compute_ms is None or call_ms is None:
        say("measuring the compute: the engine's streamed MoE layer and a decode token of the "
            "model built from its config.json (random weights)")
    compute_s, costs, compute_src = _costs(manifest, top_k, compute_ms, call_ms, dtype,
                                           machine, socket, dirs, config)
    pool = recommended_pool(machine, manifest)
    inputs = Inputs(manifest, machine, compute_s, pool, slot_bytes(manifest), costs)
    total = manifest.expert_bytes_total
    budget_list = sorted({int(total * s) for s in BUDGET_SHARES} | set(budgets or []))
    pool_list = sorted({max(1, int(pool * s)) for s in POOL_SHARES} | set(pools or []))
    say(f"simulating the workload's {len(work.calls)} layer calls at {len(budget_list)} disk "
        f"budgets and {len(pool_list)} pool sizes")
    rows = [project_row(inputs, work, pool, b, seed) for b in budget_list]
    free = _free_bytes(doctor, cache_dir)
    best = _recommend(rows, free, min(pool, total))
    pool_rows = [project_row(inputs, work, p, best["budget"], seed) for p in pool_list]
    token_bytes = int(rows[0]["bytes_per_token"])
    first = first_token_s(compute_s, token_bytes, len(manifest.shards), machine)
    result = {
        "format": PLAN_FORMAT, "version": 1,
        "model": {"repo": manifest.repo, "revision": manifest.revision,
                  "quant_format": manifest.quant_format, "moe_layers": len(manifest.moe_layers),
                  "experts_per_layer": manifest.experts_per_layer, "top_k": top_k,
                  "top_k_source": top_k_src,
                  "expert_bytes_total": total, "resident_bytes": manifest.resident_bytes_total,
                  "bytes_per_token": token_bytes},
        "workload": work.source,
        "machine": {**machine.__dict__, "free_bytes": free, "doctor_created": doctor.get("created")},
        "compute": {"ms_per_token": compute_s * 1e3, "call_ms": costs.call_s * 1e3,
                    "miss_call_ms": costs.miss_call_s * 1e3,
                    "request_ms": 0.0 if costs.request_experts else machine.request_s * 1e3,
                    "request": ("in the miss call (read through the daemon)"
                                if costs.request_experts else "the doctor's round trip"),
                    "cold_rate": costs.cold_rate or None,
                    "source": compute_src},
        "pool": {"bytes": pool, "slot_bytes": inputs.slot_bytes,
                 "rule": "cachecd_engine.pool.memory.pool_bytes_for (the engine's default)"},
        "budgets": rows, "pools": pool_rows,
        "first_token_s": first,
        "recommended": {"budget": best["budget"], "pool_bytes": pool,
                        "tok_s_cold": best["tok_s_cold"], "tok_s_warm": best["tok_s_warm"]},
    }
    if prompt is not None:
        say(f"projecting a {prompt.tokens}-token prompt's first token")
        result["prompt"] = project_prompt(inputs, top_k, prompt, (pools or [pool])[0], dtype)
    result["elapsed_s"] = round(time.perf_counter() - t0, 3)
    return result


def _workload(manifest: Manifest, traces: list[str], top_k: int | None, tokens: int, seed: int,
              config: dict[str, Any] | None) -> tuple[Any, str]:
    """The calls (the traces', or flat routing's) and where the top-k came from: --top-k, the
    traces, the model's config.json, else what cachecd knows of the model type."""
    from cachecd.plan import routing
    from cachecd.plan.token_probe import top_k_of

    if traces:
        work = routing.from_traces(manifest, traces)
        return work, "--top-k" if top_k else "the traces"
    for k, src in ((top_k, "--top-k"), (top_k_of(config or {}), "config.json"),
                   (routing.TOP_K.get(manifest.model_type), f"{manifest.model_type}'s")):
        if k:
            return routing.flat(manifest, k, tokens, seed), src
    raise InvalidRequest(f"{manifest.repo} is a {manifest.model_type} and its config.json is "
                         "not known here: give --top-k")


def project_prompt(inp: Inputs, top_k: int, prompt: PromptArgs, pool: int,
                   dtype: str) -> dict[str, Any]:
    """The first token of a prompt of ``prompt.tokens`` (``cachecd.plan.prompt``)."""
    from cachecd.plan import prompt as first
    from cachecd.plan.simulate import pool_slots
    from cachecd.plan.speed import Calls

    m = inp.manifest
    if prompt.tokens < 1 or prompt.step < 1:
        raise InvalidRequest("--prompt-tokens and --prefill-step-size must be >= 1")
    slots = pool_slots(pool, inp.slot_bytes, top_k, m.n_experts)
    reads = first.prompt_reads(m, top_k, prompt.tokens, prompt.step, slots)
    compute = (prompt.compute_ms / 1e3 if prompt.compute_ms is not None else
               first.prefill_compute_s(m, top_k, prompt.tokens, prompt.step, dtype))
    out = first.project(m, inp.machine, reads, compute, inp.costs or Calls(), pool,
                        prompt.tokens)
    out.update(pool_bytes=pool, step=prompt.step,
               compute_source="given" if prompt.compute_ms is not None else
               f"probe ({dtype}, the routed experts only)")
    return out


def _costs(manifest: Manifest, top_k: int, compute_ms: float | None,
           call_ms: list[float] | None, dtype: str, machine: Any, socket: str | None,
           cache_dirs: list[str], config: dict[str, Any] | None = None,
           ) -> tuple[float, Any, str]:
    """(compute per token, the engine's costs per call as a ``speed.Calls`` without counts,
    where the compute came from)."""
    from cachecd.plan.speed import Calls

    costs = None
    if compute_ms is None or call_ms is None:
        from cachecd.plan.probe import engine_costs

        costs = engine_costs(manifest, top_k, dtype, socket=socket, cache_dirs=cache_dirs)
    token = None if compute_ms is not None or config is None else \
        _token_s(config, manifest, top_k, dtype, machine)
    if compute_ms is not None:
        compute_s, src = compute_ms / 1e3, "given"
    elif isinstance(token, float):
        compute_s = token
        src = (f"measured: a decode token of the model built from its config.json ({dtype}, "
               f"random weights, top-{top_k} experts resident)")
    else:
        assert costs is not None
        compute_s = costs.compute_s * len(manifest.moe_layers)
        why = token or "no config.json known for the model"
        src = f"probe ({dtype}, the routed experts only: {why}; give --compute-ms)"
    if call_ms is None:
        assert costs is not None
        page_rate = machine.page_rate
        return compute_s, Calls(call_s=costs.call_s, miss_call_s=costs.miss_call_s(page_rate),
                                request_experts=costs.request_experts,
                                cold_rate=costs.cold_rate(page_rate)), src
    return compute_s, Calls(call_s=call_ms[0] / 1e3, miss_call_s=call_ms[1] / 1e3), src


def _token_s(config: dict[str, Any], manifest: Manifest, top_k: int, dtype: str,
             machine: Any) -> float | str:
    """A whole token's compute (``token_probe``), or why the model could not be built here."""
    from cachecd.plan.token_probe import MAX_BUILD_BYTES, token_s

    room = max(MAX_BUILD_BYTES, machine.available // 2)  # a run loads it all anyway
    try:
        return token_s(config, manifest, top_k, dtype, max_bytes=room)
    # mlx-lm's classes raise what they raise on a config they do not know.
    except (ValueError, KeyError, TypeError, AttributeError, ImportError) as exc:
        log.warning("token_probe_failed repo=%s error=%s", manifest.repo, exc)
        return f"mlx-lm could not build the model from its config.json ({exc})"


def recommended_pool(machine: Any, manifest: Manifest) -> int:
    """The engine's default pool (``pool_bytes_for``) for the doctor's figures, measured as the
    loader measures it: once the resident model holds its memory."""
    from cachecd_engine.pool.memory import pool_bytes_for

    available = max(0, machine.available - manifest.resident_bytes_total)
    gpu_free = (None if machine.gpu_free is None else
                max(0, machine.gpu_free - manifest.resident_bytes_total))
    return pool_bytes_for(machine.total, available, 0, machine.gpu, gpu_free)


def project_row(inp: Inputs, work: Any, pool: int, budget: int, seed: int) -> dict[str, Any]:
    from cachecd.plan.simulate import pool_slots, replay
    from cachecd.plan.speed import Calls, page_share, token_s

    slots = pool_slots(pool, inp.slot_bytes, work.top_k, inp.manifest.n_experts)
    c = replay(inp.manifest, work, slots, budget, seed=seed)
    per = c.per_token
    disk_b, hub_b = per(c.disk_hit_bytes), per(c.hub_bytes)
    compute, m = inp.compute_s, inp.machine
    calls = replace(inp.costs or Calls(), calls=per(c.calls), miss_calls=per(c.miss_calls),
                    misses=per(c.asked - c.pool_hits))
    share = page_share(m, pool, min(budget, inp.manifest.expert_bytes_total))
    cold = token_s(compute, disk_b, hub_b, m, 0.0, calls)
    warm = token_s(compute, disk_b, hub_b, m, share, calls)
    return {"budget": budget, "pool_bytes": pool, "slots": slots,
            "pool_hit_rate": c.pool_hit_rate, "disk_hit_rate": c.disk_hit_rate,
            # Of the bytes the run reads into its pool, the share the disk held (not the Hub).
            "local_rate": 1 - c.hub_bytes / read if (read := c.asked_bytes - c.pool_hit_bytes)
            else 1.0,
            "bytes_per_token": per(c.asked_bytes), "pool_bytes_per_token": per(c.pool_hit_bytes),
            "disk_bytes_per_token": disk_b, "hub_bytes_per_token": hub_b,
            "page_cache_share": share, "calls_per_token": calls.calls,
            "miss_calls_per_token": calls.miss_calls,
            "tok_s_cold": 1 / cold if cold else None, "tok_s_warm": 1 / warm if warm else None}


def _recommend(rows: list[dict[str, Any]], free: int | None, floor: int) -> dict[str, Any]:
    """The least budget within the free space that reaches GOOD_ENOUGH of the best warm tok/s
    there (by the share served locally where the Hub's rate is unknown), and not less than
    ``floor`` (the pool's bytes: what the pool held comes back from disk after a restart, not
    from the Hub) where that fits."""
    fits = [r for r in rows if free is None or r["budget"] <= free] or rows[:1]
    fits = [r for r in fits if r["budget"] >= floor] or fits[-1:]

    def score(r: dict[str, Any]) -> float:
        return r["tok_s_warm"] if r["tok_s_warm"] is not None else r["local_rate"]

    top = max(score(r) for r in fits)
    return next(r for r in fits if score(r) >= GOOD_ENOUGH * top)


def _free_bytes(doctor: dict[str, Any], cache_dir: str | None) -> int | None:
    disks = doctor["disks"]
    disk = next((d for d in disks if d["path"] == cache_dir), disks[0])
    return disk.get("free_bytes")
