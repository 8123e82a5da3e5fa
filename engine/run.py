"""``cachecd run``: greedy generation through the daemon, streaming text, with per-token stats.

Before a prefill the user is told what a cold cache costs: a long prompt can route to nearly
every expert of every layer, and each missing one is fetched from the Hub first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from cachecd.config import format_size


def load(repo: str, socket: str | Path | None = None, *, ram_bytes: int | None = None,
         expert_memory: int | None = None, stats: Any = None, trace: str | Path | None = None,
         prefetch: bool | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a registered model, as ``mlx_lm.load`` returns them.

    The resident weights come from the local files ``cachecd setup --stream`` installed; every
    routed expert comes through the daemon on ``socket``. ``mlx_lm.generate`` and
    ``stream_generate`` work unchanged on the result. With ``trace`` (or ``CACHECD_TRACE``) the
    routing is recorded to that file (``cachecd_engine.trace``), closed at exit.
    """
    from cachecd_engine.daemon_source import DaemonSource
    from cachecd_engine.loader import load as load_dir

    source, local_dir = DaemonSource.connect(repo, socket)
    model, tokenizer = load_dir(local_dir, source, ram_bytes=ram_bytes, expert_memory=expert_memory,
                                stats=stats, prefetch=prefetch)
    _attach_trace(model, repo, trace)
    return model, tokenizer


def _attach_trace(model: Any, repo: str, path: str | Path | None) -> None:
    import atexit

    from cachecd import constants
    from cachecd_engine.trace import TraceRecorder

    path = path or constants.TRACE_PATH
    if path:
        recorder = TraceRecorder(path, repo)
        model.bank.trace = recorder
        atexit.register(recorder.close)


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="generate through the daemon (greedy)")
    p.add_argument("--model", required=True, help="ORG/NAME, installed with setup --stream")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new", type=int, default=64, help="tokens to generate")
    p.add_argument("--socket")
    p.add_argument("--ram", default="auto",
                   help="RAM tier for hot experts, e.g. 8GiB; 0 disables; auto (default): a quarter "
                        "of the memory left once the model is loaded")
    p.add_argument("--expert-memory", default="auto",
                   help="bound on the buffers a layer's experts are read into, e.g. 2GiB; a long "
                        "prefill runs in groups within it (auto: 4GiB, at most 1/8 of RAM)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=None,
                   help="read the next layer's likely experts ahead while a layer computes "
                        "(default: on where the model computes on a GPU, off on the CPU)")
    p.add_argument("--stats", action="store_true", help="per-token stats on stderr")
    p.add_argument("--json", action="store_true", help="print token ids and per-token stats as JSON")
    p.add_argument("--trace", metavar="FILE",
                   help="record the routing (JSON lines; replay with cachecd warm --trace)")
    p.set_defaults(func=run)


def cold_cost_notice(client: Any, repo: str) -> str:
    cov = client.coverage(repo)
    missing = cov["bytes_total"] - cov["bytes_cached"]
    if not missing:
        return f"cache: every expert of {repo} is local"
    return (f"cache: {format_size(cov['bytes_cached'])} of {format_size(cov['bytes_total'])} of experts "
            f"are local; a long prefill can route to any expert, so up to {format_size(missing)} may "
            f"be fetched first (warm it ahead: cachecd warm)")


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx_lm import stream_generate

    from cachecd_engine.bank import EngineStats

    stats = EngineStats()
    model, tokenizer = load(args.model, args.socket, ram_bytes=_size(args.ram, "--ram"),
                            expert_memory=_size(args.expert_memory, "--expert-memory"), stats=stats,
                            trace=args.trace, prefetch=args.prefetch)
    bank_source = model.bank.source
    print(cold_cost_notice(bank_source.client, args.model), file=sys.stderr)
    prompt: Any = args.prompt
    if args.chat and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True)
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    last = None
    client = bank_source.client
    fetched = client.upstream_fetches
    for resp in stream_generate(model, tokenizer, prompt, max_tokens=args.max_new):
        now = time.perf_counter()
        step = {"token": int(resp.token), "text": resp.text, "s": round(now - t0, 6), **stats.snapshot(),
                "fetched_upstream": client.upstream_fetches - fetched}
        fetched = client.upstream_fetches
        stats.reset()
        t0, last = now, resp
        records.append(step)
        if not args.json:
            sys.stdout.write(resp.text)
            sys.stdout.flush()
        if args.stats and not args.json:
            print(_stat_line(len(records), step), file=sys.stderr)
    mx.synchronize()
    if args.json:
        print(json.dumps({"model": args.model, "tokens": [r["token"] for r in records],
                          "text": "".join(r["text"] for r in records), "per_token": records,
                          "prompt_tps": last.prompt_tps if last else 0.0,
                          "generation_tps": last.generation_tps if last else 0.0}))
    else:
        print()
        if last is not None:
            print(f"prompt {last.prompt_tokens} tokens at {last.prompt_tps:.1f} tok/s, generated "
                  f"{last.generation_tokens} at {last.generation_tps:.1f} tok/s", file=sys.stderr)
    model.bank.close()
    bank_source.close()
    if model.bank.trace is not None:
        model.bank.trace.close()
    return 0


def _size(value: str, flag: str) -> int | None:
    from cachecd.config import parse_size

    return None if value == "auto" else parse_size(value, flag)


def _stat_line(i: int, s: dict[str, Any]) -> str:
    return (f"token {i}: routed {s['experts_routed']} RAM hits {s['ram_hits']} read ahead "
            f"{s['staged_hits']} daemon {s['source_hits']} of which fetched upstream "
            f"{s['fetched_upstream']} ({format_size(s['source_bytes'])}) waited for experts "
            f"{s['wait_s'] * 1000:.1f} ms total {s['s'] * 1000:.1f} ms")
