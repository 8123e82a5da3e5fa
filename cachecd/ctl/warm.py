"""``cachecd warm``: fill the cache ahead of a workload, with a progress bar, resumably.

Sources of the workload: ``--prompts FILE`` runs the engine (prefill and a few tokens each, each
prompt in the model's chat template as ``cachecd run`` sends it, so warming routes as chatting
will), so the daemon fetches exactly what routing needs (its reads counted as warming, not use); ``--trace FILE``
replays a recorded routing trace; ``--top N`` and ``--bytes SIZE`` take the most-used missing
experts by the daemon's access counts.

Invariants:
- Resumable: the plan is computed from what the daemon has cached now, so a rerun skips what an
  earlier (interrupted) run fetched; every batch the daemon finished is committed, and a batch in
  flight when Ctrl-C arrives still completes in the daemon (its fetch is shielded).
- Warming is not use: trace, top and bytes go through the daemon's ``warm`` route, and the
  engine's reads for --prompts are marked as warming, so the daemon fetches without touching
  access counts or hit statistics (its ``warm_fetched_experts`` counts them), and warming never
  inflates the statistics it reads.
- A daemon registered for some layers only (``setup --pipeline``) is warmed with those layers'
  share of the workload: a trace recorded on one machine warms each rank of a pipelined set
  with its own layers, and the hit rates shown are over those layers.
- The budget and pins are the daemon's to enforce; by default the plan stops at the free room
  under the budget, so warming never evicts what is cached (``--allow-evict`` lifts that).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cachecd.cli_help import count
from cachecd.config import add_common_arguments, parse_size
from cachecd.ctl import MODEL_HELP
from cachecd.ctl.coverage import (
    DAEMON_WORKLOAD,
    Snapshot,
    add_trace_flag,
    client_for,
    snapshot,
    trace_access,
    trace_label,
)
from cachecd.ctl.warm_batches import BAR_FORMAT, Outcome, plan_batches, run_batches
from cachecd.errors import CachecdError, InvalidRequest
from cachecd.report.coverage import access_array, served_mask, trace_weighted, warm_order
from cachecd.sizes import format_size
from cachecd_engine.run import PREFILL_STEP, add_chat_flag, add_trust_flag

__all__ = ["fit_room", "plan_batches", "read_prompts", "register", "warm"]


@dataclass
class Plan:
    rows: np.ndarray  # manifest rows to fetch, in priority order
    workload: np.ndarray  # per-row weights the hit rate is computed with
    label: str
    notes: list[str] = field(default_factory=list)


def fit_room(sizes_in_order: np.ndarray, room: int) -> int:
    """How many of the planned experts (in order) fit in ``room`` bytes."""
    return int(np.searchsorted(np.cumsum(sizes_in_order), room, side="right"))


def register(sub: Any) -> None:
    p = sub.add_parser("warm", help="warm the cache for a workload (prompts, a trace, the top experts)")
    p.add_argument("--model", help=MODEL_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", metavar="FILE", help="one prompt a line (or JSON lines with \"prompt\")")
    add_trace_flag(src, "a routing trace (cachecd run --trace)")
    src.add_argument("--top", type=count(1), metavar="N", help="the N most-used missing experts")
    src.add_argument("--bytes", metavar="SIZE", help="the most-used missing experts up to SIZE, e.g. 20GB")
    p.add_argument("--max-tokens", "--max-new", dest="max_new", type=count(1), default=4,
                   help="tokens generated per prompt (--prompts)")
    p.add_argument("--prefill-step-size", type=count(1), default=PREFILL_STEP,
                   help="prompt tokens per prefill step (--prompts; default %(default)s, as "
                        "cachecd run)")
    p.add_argument("--save-trace", metavar="FILE",
                   help="keep the routing of --prompts as a trace (default: not kept)")
    add_chat_flag(p)
    add_trust_flag(p)
    p.add_argument("--parallel", type=count(1), default=2, help="requests in flight to the daemon")
    p.add_argument("--batch", type=count(1), default=16, help="experts per request (one layer each)")
    p.add_argument("--allow-evict", action="store_true",
                   help="go past the free room under the budget (the daemon evicts by policy)")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    add_common_arguments(p)
    p.set_defaults(func=warm)


def warm(args: argparse.Namespace) -> int:
    from cachecd_client import resolve_model

    args.model = resolve_model(args.model, args.socket)
    with client_for(args.socket) as client:
        before = snapshot(client, args.model)
        if args.prompts:
            return _warm_prompts(args, client, before)
        plan = _plan(args, before)
        plan = _fit_budget(args, client.stats()["store"], before, plan)
        return _warm_plan(args, client, before, plan)


def _plan(args: argparse.Namespace, snap: Snapshot) -> Plan:
    m = snap.manifest
    if args.trace:
        workload, label = trace_access(m, args.trace), trace_label(args.trace)
    else:
        workload, label = snap.access, DAEMON_WORKLOAD
    workload, notes = _served_share(snap, workload, label)
    order = warm_order(m.sizes, snap.cached, workload)
    if args.top is not None:
        if args.top < 0:
            raise InvalidRequest("--top must be >= 0")
        order = order[:args.top]
    elif args.bytes is not None:
        order = order[:fit_room(m.sizes[order], parse_size(args.bytes, "--bytes"))]
    plan = Plan(order, workload, label, notes)
    if not workload.any():
        plan.notes.append(f"no recorded workload in {label}: nothing to rank experts by "
                          "(run the model first, or warm --prompts / --trace)")
    elif not len(order) and args.top != 0:
        used = int((workload > 0).sum())
        plan.notes.append(f"nothing to warm: all {used} experts {label} used are cached already, "
                          "and the others were never used, so nothing ranks them; warm for "
                          "another workload with --trace FILE or --prompts FILE")
    return plan


def _served_share(snap: Snapshot, workload: np.ndarray, label: str) -> tuple[np.ndarray, list[str]]:
    """The workload over the layers the daemon serves (all of them unless it is one rank's)."""
    if snap.layers is None:
        return workload, []
    served = served_mask(snap.manifest, snap.layers)
    other = int(workload[~served].sum())
    rank = (f" (pipeline rank {snap.pipeline['rank']} of {snap.pipeline['size']})"
            if snap.pipeline else "")
    note = (f"this daemon serves layers {snap.layers[0]}-{snap.layers[1] - 1}{rank}: warming "
            f"those; {other} accesses of {label} are other layers' (warm them on the machines "
            f"that run those layers)")
    return np.where(served, workload, 0), [note]


def _fit_budget(args: argparse.Namespace, store: dict[str, Any], snap: Snapshot, plan: Plan) -> Plan:
    budget = int(store.get("budget") or 0)
    if not budget or args.allow_evict:
        return plan
    room = max(budget - int(store.get("bytes", 0)) - int(store.get("reserved", 0)), 0)
    keep = fit_room(snap.manifest.sizes[plan.rows], room)
    if keep < len(plan.rows):
        plan.notes.append(
            f"budget: {format_size(room)} free of {format_size(budget)}; warming {keep} of "
            f"{len(plan.rows)} experts so nothing cached is evicted (--allow-evict to go on, "
            f"or raise the budget)")
        plan.rows = plan.rows[:keep]
    return plan


def _rate_line(label: str, workload: np.ndarray, before: np.ndarray, after: np.ndarray) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    return (f"expected hit rate: {pct(trace_weighted(before, workload))} before, "
            f"{pct(trace_weighted(after, workload))} after "
            f"(workload: {label}, {int(workload.sum())} accesses)")


def _warm_plan(args: argparse.Namespace, client: Any, before: Snapshot, plan: Plan) -> int:
    m = before.manifest
    for note in plan.notes:
        print(note, file=sys.stderr)
    total = int(m.sizes[plan.rows].sum())
    print(f"warming {len(plan.rows)} experts ({format_size(total)}) of {args.model}; "
          f"expected hit rate now {_pct(trace_weighted(before.cached, plan.workload))} "
          f"(workload: {plan.label})")
    batches = plan_batches(m.layer_ids, m.expert_ids, m.sizes, plan.rows, max(args.batch, 1))
    t0 = time.monotonic()
    outcome = run_batches(lambda: client_for(args.socket), args.model, batches, total,
                          max(args.parallel, 1))
    after = snapshot(client, args.model, m)
    return _finish(args, outcome, time.monotonic() - t0, plan.label, plan.workload, before, after)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _finish(args: argparse.Namespace, outcome: Outcome, seconds: float, label: str,
            workload: np.ndarray, before: Snapshot, after: Snapshot) -> int:
    print(f"fetched {outcome.fetched} experts ({format_size(outcome.fetched_bytes)}) in {seconds:.1f} s")
    print(_rate_line(label, workload, before.cached, after.cached))
    code = 0
    if outcome.interrupted:
        print("interrupted: everything fetched so far stays cached; run the same command again "
              "to continue", file=sys.stderr)
        code = 130
    elif outcome.error is not None:
        err = outcome.error
        print(f"cachecd: warm stopped: {err.code}: {err.message} (what was fetched stays "
              "cached; run the same command again to continue)", file=sys.stderr)
        code = err.exit_code
    if args.json:
        print(json.dumps({
            "model": args.model, "workload": label, "fetched": outcome.fetched,
            "fetched_bytes": outcome.fetched_bytes, "seconds": round(seconds, 3),
            "hit_rate_before": trace_weighted(before.cached, workload),
            "hit_rate_after": trace_weighted(after.cached, workload),
            "experts_cached": int(after.cached.sum()), "exit": code,
        }))
    return code


def read_prompts(path: str | Path) -> list[str]:
    """Prompts, one a line; a line that is a JSON object gives its ``prompt`` field."""
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InvalidRequest(f"{path}:{number}: a JSON line needs a \"prompt\" field") from None
        else:
            prompts.append(line)
    if not prompts:
        raise InvalidRequest(f"{path} has no prompts")
    return prompts


def _warm_prompts(args: argparse.Namespace, client: Any, before: Snapshot) -> int:
    from huggingface_hub.utils import tqdm  # honours HF_HUB_DISABLE_PROGRESS_BARS
    from mlx_lm import stream_generate

    from cachecd_engine.pool.bank import EngineStats
    from cachecd_engine.prefill_progress import LayerPostfix, watch
    from cachecd_engine.run import load, prompt_input
    from cachecd_engine.trace import TraceRecorder

    prompts = read_prompts(args.prompts)
    stats = EngineStats()
    model, tokenizer = load(args.model, args.socket, trust_remote_code=args.trust_remote_code,
                            stats=stats)
    model.bank.source.client.warming = True  # the daemon counts these reads as warm, not use
    recorder = TraceRecorder(args.save_trace, args.model.partition("@")[0], append=True)
    model.bank.trace = recorder
    start_bytes = client.stats()["counters"].get("fetched_bytes", 0)
    outcome, t0 = Outcome(), time.monotonic()
    bar = tqdm(total=len(prompts), unit="prompt", desc="warm", disable=None, file=sys.stderr,
               bar_format=BAR_FORMAT)
    beside = LayerPostfix(stats, model.bank.source.client, bar)  # a pass in layer order
    watch(model, beside)
    model.bank.source.client.on_wait(beside.wait)  # and a layer's wait on the Hub
    try:
        for beside.prompt, prompt in enumerate(prompts, 1):
            text = prompt_input(tokenizer, prompt, args.chat)
            for _ in stream_generate(model, tokenizer, text, max_tokens=args.max_new,
                                     prefill_step_size=args.prefill_step_size):
                pass
            fetched = client.stats()["counters"].get("fetched_bytes", 0) - start_bytes
            bar.set_postfix_str(f"fetched {format_size(fetched)}")
            bar.update(1)
    except KeyboardInterrupt:
        outcome.interrupted = True
    except CachecdError as exc:
        outcome.error = exc
    finally:
        bar.close()
        recorder.close()
        model.bank.source.close()
    after = snapshot(client, args.model, before.manifest)
    outcome.fetched = int((after.cached & ~before.cached).sum())
    outcome.fetched_bytes = int(before.manifest.sizes[after.cached & ~before.cached].sum())
    workload = access_array(before.manifest, recorder.trace.counts)
    return _finish(args, outcome, time.monotonic() - t0, f"prompts {args.prompts}", workload,
                   before, after)

