"""Decode tokens/s: the streamed engine through a real daemon vs the fully resident mlx-lm model.

The default tiny K3 checkpoint is served by ``cachecd hub serve``; ``cachecd setup --stream``
installs it and starts a daemon; every expert is then cached on disk (one warm-up pass). In one
process, alternating rounds, the same greedy decode (one ``mx.eval`` per token, the model's own
KV cache, the same prompt) runs on:
  resident: ``mlx_lm.utils.load_model(checkpoint_dir)``, every weight in memory;
  warm:     ``cachecd_engine.run.load(repo, socket, ram_bytes=...)`` with a RAM tier that holds
            every expert (after warm-up no layer asks the daemon);
  ram0:     the same with a RAM tier of 0 bytes: every MoE layer of every token asks the daemon.
All three must emit the same tokens. Prints tok/s (wall clock, and per CPU second of this
process, which other load on a shared machine disturbs less; it leaves out the daemon's own CPU,
which matters for ram0), the streamed engines' per-token breakdown from ``model.bank.stats``,
and ratio = warm / resident by the wall clock (the bar is >= 0.9).

``--source local`` skips the daemon: the streamed engine reads the checkpoint in-process
(``LocalSource``), which isolates the engine's own cost from the daemon's.

    python bench/engine.py [--fmt mxfp4|fp32] [--tokens 64] [--rounds 12] [--source daemon|local]
                           [--dir /tmp]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from _common import (
    Served,
    add_common_args,
    alternate,
    installed,
    median,
    paired_ratio,
    served_checkpoint,
    warm_disk,
)
from mlx_lm.utils import load_model

REPO = "bench/tiny-k3"
PROMPT = "Once upon a time, in a land far away, a tiny model streamed its experts"
RAM_ALL = 1 << 30  # far more than every tiny expert decoded


@dataclass
class Case:
    model: Any
    tps: list[float] = field(default_factory=list)
    cpu_tps: list[float] = field(default_factory=list)
    per_token: dict[str, list[float]] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)


def decode(model: Any, prompt: mx.array, n: int) -> tuple[float, float, list[int]]:
    """Greedy decode of ``n`` tokens after the prompt; (wall s, CPU s, token ids)."""
    cache = model.make_cache()
    logits = model(prompt, cache=cache)
    mx.eval(logits)
    out: list[int] = []
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        tok = mx.argmax(logits[:, -1], axis=-1)
        logits = model(tok[:, None], cache=cache)
        mx.eval(logits)
        out.append(int(tok.item()))
    return time.perf_counter() - t0, time.process_time() - c0, out


def runner(case: Case, prompt: mx.array, n: int) -> Callable[[], float]:
    def run() -> float:
        bank = getattr(case.model, "bank", None)
        if bank is not None:
            bank.stats.reset()
        wall, cpu, toks = decode(case.model, prompt, n)
        case.tps.append(n / wall)
        case.cpu_tps.append(n / cpu)
        if case.tokens and toks != case.tokens:
            raise SystemExit("the same greedy decode emitted different tokens across rounds")
        case.tokens = toks
        if bank is not None:
            for k, v in bank.stats.snapshot().items():
                case.per_token.setdefault(k, []).append(v / n)
        return n / wall

    return run


@contextlib.contextmanager
def streamed_models(served: Served, source: str) -> Iterator[tuple[Any, Any, Any]]:
    """(warm model, RAM-0 model, tokenizer), through the daemon or an in-process LocalSource."""
    if source == "daemon":
        from cachecd_engine.run import load

        with installed(served) as (sock, _):
            warm_disk(sock, served)
            warm, tok = load(served.repo, sock, ram_bytes=RAM_ALL)
            ram0, _ = load(served.repo, sock, ram_bytes=0)
            try:
                yield warm, ram0, tok
            finally:
                warm.bank.source.close()
                ram0.bank.source.close()
        return
    from cachecd_engine.loader import load as load_dir
    from cachecd_engine.local_source import LocalSource, manifest_from_dir

    with LocalSource(manifest_from_dir(served.repo_dir), served.repo_dir, verify=False) as src:
        warm, tok = load_dir(served.repo_dir, src, ram_bytes=RAM_ALL)
        ram0, _ = load_dir(served.repo_dir, src, ram_bytes=0)
        yield warm, ram0, tok


def report(cases: dict[str, Case], n: int) -> None:
    ref = median(cases["resident"].tps)
    ref_cpu = median(cases["resident"].cpu_tps)
    for name, c in cases.items():
        print(
            f"{name:9s} tok/s={median(c.tps):7.1f} (x{median(c.tps) / ref:.3f})   "
            f"tok/CPU-s={median(c.cpu_tps):7.1f} (x{median(c.cpu_tps) / ref_cpu:.3f})"
        )
    for name in ("warm", "ram0"):
        s = {k: median(v) for k, v in cases[name].per_token.items()}
        print(
            f"{name:9s} per token: {s['layer_calls']:.0f} MoE layer calls, "
            f"{s['experts_routed']:.1f} experts routed, {s['ram_hits']:.1f} RAM hits, "
            f"{s['source_hits']:.1f} from the source ({s['source_bytes']:.0f} B), "
            f"{s['staged_hits']:.1f} of them read ahead, expert wait {s['wait_s'] * 1e3:.2f} ms, "
            f"plan/views {s['plan_s'] * 1e3:.2f} ms, "
            f"whole token {1e3 / median(cases[name].tps):.2f} ms "
            f"(resident {1e3 / ref:.2f} ms)"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, rounds=12)
    ap.add_argument("--fmt", default="mxfp4", choices=["mxfp4", "fp32"])
    ap.add_argument("--tokens", type=int, default=64, help="greedy decode steps a round")
    ap.add_argument("--source", default="daemon", choices=["daemon", "local"])
    args = ap.parse_args(argv)
    with served_checkpoint(args.dir, REPO, fmt=args.fmt) as served:
        resident, _ = load_model(served.repo_dir)
        with streamed_models(served, args.source) as (warm, ram0, tokenizer):
            prompt = mx.array(tokenizer.encode(PROMPT))[None]
            cases = {"resident": Case(resident), "warm": Case(warm), "ram0": Case(ram0)}
            alternate(
                {k: runner(c, prompt, args.tokens) for k, c in cases.items()},
                args.rounds,
                lambda k, v: f"{k}={v:.1f}tok/s",
            )
    for c in cases.values():  # drop the warm-up round
        for values in (c.tps, c.cpu_tps, *c.per_token.values()):
            del values[0]
    if len({tuple(c.tokens) for c in cases.values()}) != 1:
        raise SystemExit("streamed and resident greedy decodes emitted different tokens")
    print(
        f"engine: fmt={args.fmt} source={args.source} {args.tokens} tokens a round, "
        f"rounds={args.rounds}, same tokens from all three"
    )
    report(cases, args.tokens)
    paired = {k: paired_ratio(cases[k].tps, cases["resident"].tps) for k in ("warm", "ram0")}
    print(f"info: median of per-round ratios: warm={paired['warm']:.3f} ram0={paired['ram0']:.3f}")
    print(f"ratio={median(cases['warm'].tps) / median(cases['resident'].tps):.3f}")


if __name__ == "__main__":
    main()
