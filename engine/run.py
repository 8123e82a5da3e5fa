"""``cachecd run``: generation through the daemon as ``mlx_lm.generate`` does it, with per-token stats.

Greedy unless asked to sample (``--temp``, ``--top-p``, ``--top-k``, ``--min-p``, ``--seed``: the
defaults are mlx_lm.generate's). The prompt goes in the model's chat template when the tokenizer
has one, as mlx_lm.generate does (``--no-chat`` sends it as it is). Before a prefill the user is
told what a cold cache costs: a long prompt can route to nearly every expert of every layer, and
each missing one is fetched from the Hub first; a prefill longer than one step prints its
progress: layers done of all (it runs layer by layer, ``prefill_defer``), experts read and
fetched, bytes, rate and time left; tokens done of all where it runs step by step.

Under ``mlx.launch`` the model is pipelined over the ranks (``cachecd_engine.pipeline``): every
rank generates the same tokens, rank 0 prints the output, each rank's notices and ``--stats``
lines on stderr start with its rank, and ``--json`` gives per token the sum over the ranks and
each rank's own figures (gathered once generation is over).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from cachecd.cli_help import count, number
from cachecd.config import add_common_arguments
from cachecd.sizes import format_size

# mlx_lm.generate's defaults (DEFAULT_TEMP, ...): literals so `cachecd --help` needs no mlx
# import; tests/unit/test_openai_cli.py holds them equal to mlx-lm's.
TEMP, TOP_P, TOP_K, MIN_P, PREFILL_STEP = 0.0, 1.0, 0, 0.0, 2048


def load(repo: str, socket: str | Path | None = None, **engine: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a registered model (``cachecd_engine.load`` with the engine's
    keywords: ram_bytes, expert_memory, stats, trace, prefetch, speculate, and
    trust_remote_code)."""
    from cachecd_engine.registered import load as load_registered

    return load_registered(repo, socket=socket, **engine)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags that set the engine (``cachecd run`` and ``cachecd openai``)."""
    add_common_arguments(p)
    p.add_argument("--ram", default="auto",
                   help="the pool of expert slots every layer's kernel reads (experts kept in "
                        "memory), e.g. 8GiB; 0: the smallest (two experts); auto (default): "
                        "measured, what the machine holds beside the page cache, and resized "
                        "while it runs")
    p.add_argument("--expert-memory", default="auto",
                   help="a hard cap on the pool's memory, e.g. 2GiB; a call routing to more "
                        "experts than the pool holds (a long prefill) runs in groups within it "
                        "(auto: no cap beyond --ram)")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=None,
                   help="read the next layer's likely experts ahead while a layer computes "
                        "(default: off: slower where measured, on the CPU and on CUDA)")
    p.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=None,
                   help="run each decode step with the expert->slot map on the device, with no "
                        "per-layer round trip, and keep it when every expert it routed to was "
                        "in the pool (else run it again the per-layer way; the output is the "
                        "same either way) (default: on a GPU, off on the CPU)")


def add_trust_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let the tokenizer run the code its repo ships (Kimi's "
                        "tokenization_kimi.py), as pinned by sha256 in the manifest")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """``cachecd_engine.load`` keywords from ``add_engine_flags``' flags."""
    return {"socket": args.socket, "ram_bytes": _size(args.ram, "--ram"),
            "expert_memory": _size(args.expert_memory, "--expert-memory"),
            "prefetch": args.prefetch, "speculate": args.speculate}

# --model of run and openai, resolved with cachecd_client.resolve_model when left out.
MODEL_HELP = ("ORG/NAME[@REV], installed with setup --stream (default: the one model the daemon has "
              "registered)")


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="generate through the daemon (greedy unless --temp)")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--prompt", required=True, help="the prompt; '-' reads it from standard input")
    p.add_argument("--max-tokens", "--max-new", dest="max_tokens", type=count(1), default=64,
                   help="tokens to generate (default 64)")
    p.add_argument("--temp", type=number(0), default=TEMP, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=number(0, 1), default=TOP_P, help="nucleus sampling top-p")
    p.add_argument("--top-k", type=count(0), default=TOP_K, help="top-k sampling (0: off)")
    p.add_argument("--min-p", type=number(0, 1), default=MIN_P, help="min-p sampling (0: off)")
    p.add_argument("--seed", type=int, help="PRNG seed: the same seed samples the same text "
                   "(default: unseeded)")
    p.add_argument("--prefill-step-size", type=count(1), default=PREFILL_STEP,
                   help="prompt tokens per prefill step (progress is printed after each)")
    add_engine_flags(p)
    add_trust_flag(p)
    add_chat_flag(p)
    p.add_argument("--stats", action="store_true", help="per-token stats on stderr")
    p.add_argument("--json", action="store_true", help="print token ids and per-token stats as JSON")
    p.add_argument("--trace", metavar="FILE",
                   help="record the routing (JSON lines, after the runs already in FILE; "
                        "replay with cachecd warm --trace; default: CACHECD_TRACE, else not "
                        "recorded)")
    p.set_defaults(func=run)


def add_chat_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: when the "
                        "tokenizer has one, as mlx_lm.generate does)")


def prompt_input(tokenizer: Any, text: str, chat: bool | None) -> str | list[int]:
    """What to hand ``stream_generate`` for ``text``: with the chat template (``chat`` None: when
    the tokenizer has one), the ids mlx_lm.generate makes (the template rendered, then encoded
    without adding special tokens); else the text, which stream_generate encodes as it does."""
    has_template = bool(getattr(tokenizer, "has_chat_template", False))
    if chat and not has_template:
        print("the tokenizer has no chat template: the prompt goes in as it is", file=sys.stderr)
    if not (has_template if chat is None else chat and has_template):
        return text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def cold_cost_notice(client: Any, repo: str) -> str:
    cov = client.coverage(repo)
    missing = cov["bytes_total"] - cov["bytes_cached"]
    if not missing:
        return f"cache: every expert of {repo} is local"
    return (f"cache: {format_size(cov['bytes_cached'])} of {format_size(cov['bytes_total'])} of experts "
            f"are local; a long prefill can route to any expert, so up to {format_size(missing)} may "
            f"be fetched first (warm it ahead: cachecd warm)")


class PrefillProgress:
    """mlx-lm's ``prompt_progress_callback``: a stderr line after each step of a prefill longer
    than one step (after each layer when it runs layer by layer: ``prefill_progress``), with the
    experts read through the daemon and fetched from the Hub so far."""

    def __init__(self, stats: Any, client: Any, step: int, prefix: str = "") -> None:
        from cachecd_engine.prefill_progress import LayerFigures

        self.stats, self.client, self.step, self.prefix = stats, client, step, prefix
        self.deferral: Any = None  # the model's, when its prefill runs layer by layer
        self.t0 = time.perf_counter()
        self.fetched0 = client.upstream_fetches
        self.figures = LayerFigures(stats, client)

    def __call__(self, done: int, total: int) -> None:
        # A held-back step has not run yet; during a pass the layer lines say where it is.
        busy = self.deferral is not None and (self.deferral.held or self.deferral.running)
        if total <= self.step or done == 0 or busy:
            return
        s = self.stats
        print(f"{self.prefix}prefill {done}/{total} tokens: {s.source_hits} experts read "
              f"through the daemon ({format_size(s.source_bytes)}), "
              f"{self.client.upstream_fetches - self.fetched0} fetched from the Hub, "
              f"{time.perf_counter() - self.t0:.1f} s", file=sys.stderr, flush=True)

    def layer(self, done: int, layers: int) -> None:
        """A layer-by-layer prefill (``prefill_defer``): a line after each layer."""
        if done == 0:
            self.figures.start()
        else:
            print(self.prefix + self.figures.line(done, layers), file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from cachecd_client import resolve_model
    from cachecd_engine.kernels import compiling_notice
    from cachecd_engine.pipeline import launched_group, shared_seed
    from cachecd_engine.pool.bank import EngineStats

    compiling = compiling_notice()  # asked before the load, which may compile a kernel too
    args.model = resolve_model(args.model, args.socket)
    group = launched_group()
    prefix = f"rank {group.rank()}: " if group is not None else ""
    stats = EngineStats()
    # Seeded before the load, as mlx_lm.generate seeds: building the model draws from the PRNG
    # (its layers' initial weights), so seeding after would sample other text than it does.
    seed = args.seed if args.seed is not None or group is None else shared_seed(group)
    if seed is not None:
        mx.random.seed(seed)
    model, tokenizer = load(args.model, stats=stats, trace=args.trace, pipeline=group or False,
                            trust_remote_code=args.trust_remote_code, **engine_options(args))
    bank_source = model.bank.source
    try:
        print(prefix + cold_cost_notice(bank_source.client, args.model), file=sys.stderr)
        if compiling is not None:
            print(prefix + compiling, file=sys.stderr)
        records, last = _generate(args, model, tokenizer, stats, prefix,
                                  quiet=group is not None and group.rank() != 0)
        settle()
        if group is not None:
            records = merge_ranks(group, records)
    finally:
        model.bank.close()
        bank_source.close()
        if model.bank.trace is not None:
            model.bank.trace.close()
    if group is None or group.rank() == 0:
        _summary(args, records, last)
    return 0


def settle() -> None:
    """Wait for what mlx-lm left running: ``generate_step`` computes one step past the last
    token, and pipelined that step holds collectives; a collective of ours must not cross them."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()


def merge_ranks(group: Any, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per token, the figures summed over the ranks (``s``: rank 0's time) and each rank's own
    under ``per_rank``. Every rank generated the same tokens, so the records line up."""
    from cachecd_engine.pipeline import gather_ints

    if not records:
        return records
    keys = [k for k in records[0] if k not in ("token", "text", "logprob")]
    # Seconds travel as integer microseconds: one int64 collective for every figure.
    scale = {k: 1_000_000 if isinstance(records[0][k], float) else 1 for k in keys}
    rows = [[round(r[k] * scale[k]) for k in keys] for r in records]
    ranks = gather_ints(group, rows)  # (ranks, tokens, keys)
    merged = []
    for i, r in enumerate(records):
        per_rank = [{k: _unscale(int(ranks[g, i, j]), scale[k]) for j, k in enumerate(keys)}
                    for g in range(ranks.shape[0])]
        total = {k: _unscale(int(ranks[:, i, j].sum()), scale[k]) for j, k in enumerate(keys)}
        total["s"] = r["s"]
        merged.append({"token": r["token"], "text": r["text"], "logprob": r["logprob"], **total,
                       "per_rank": per_rank})
    return merged


def _unscale(value: int, scale: int) -> float | int:
    return value / scale if scale != 1 else value


def _prompt(args: argparse.Namespace, tokenizer: Any) -> str | list[int]:
    return prompt_input(tokenizer, sys.stdin.read() if args.prompt == "-" else args.prompt,
                        args.chat)


def _generate(args: argparse.Namespace, model: Any, tokenizer: Any, stats: Any, prefix: str = "",
              quiet: bool = False) -> tuple[list[dict[str, Any]], Any]:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from cachecd_engine.prefill_progress import wait_line, watch

    client = model.bank.source.client
    sampler = make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)
    progress = PrefillProgress(stats, client, args.prefill_step_size, prefix)
    if watch(model, progress.layer):
        progress.deferral = model.deferral
    if not quiet:  # a cold layer's wait on the Hub, about once a second
        client.on_wait(lambda p: print(prefix + wait_line(p), file=sys.stderr, flush=True))
    records: list[dict[str, Any]] = []
    t0, last, fetched = time.perf_counter(), None, client.upstream_fetches
    try:
        for resp in stream_generate(model, tokenizer, _prompt(args, tokenizer),
                                    max_tokens=args.max_tokens, sampler=sampler,
                                    prefill_step_size=args.prefill_step_size,
                                    prompt_progress_callback=progress):
            now = time.perf_counter()
            step = {"token": int(resp.token), "text": resp.text, "s": round(now - t0, 6),
                    "logprob": float(resp.logprobs[resp.token].item()),  # type: ignore[arg-type]
                    **stats.snapshot(), "fetched_upstream": client.upstream_fetches - fetched}
            fetched = client.upstream_fetches
            stats.reset()
            t0, last = now, resp
            records.append(step)
            if not args.json and not quiet:
                sys.stdout.write(resp.text)
                sys.stdout.flush()
            if args.stats and not args.json:
                print(prefix + _stat_line(len(records), step), file=sys.stderr)
    except BaseException:  # Ctrl-C or an error mid-text: the text's line ends before the error
        if records and not args.json and not quiet:
            print(flush=True)
        raise
    return records, last


def _summary(args: argparse.Namespace, records: list[dict[str, Any]], last: Any) -> None:
    if args.json:
        print(json.dumps({"model": args.model, "tokens": [r["token"] for r in records],
                          "text": "".join(r["text"] for r in records), "per_token": records,
                          "prompt_tps": last.prompt_tps if last else 0.0,
                          "generation_tps": last.generation_tps if last else 0.0}))
        return
    print()
    if last is not None:
        print(f"prompt {last.prompt_tokens} tokens at {last.prompt_tps:.1f} tok/s, generated "
              f"{last.generation_tokens} at {last.generation_tps:.1f} tok/s", file=sys.stderr)


def _size(value: str, flag: str) -> int | None:
    from cachecd.config import parse_size

    return None if value == "auto" else parse_size(value, flag)


def _stat_line(i: int, s: dict[str, Any]) -> str:
    return (f"token {i}: routed {s['experts_routed']} RAM hits {s['ram_hits']} read ahead "
            f"{s['staged_hits']} daemon {s['source_hits']} of which fetched upstream "
            f"{s['fetched_upstream']} ({format_size(s['source_bytes'])}) waited for experts "
            f"{s['wait_s'] * 1000:.1f} ms total {s['s'] * 1000:.1f} ms")
