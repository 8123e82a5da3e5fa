"""``cachecd run``: generation through the daemon as ``mlx_lm.generate`` does it, with per-token stats.

Takes mlx_lm.generate's flags with their meanings (``run_mlx``: its own ``main()`` builds the
prompt, the chat template with a system prompt or a prefilled response, and the sampler; greedy
unless asked to sample). The prompt goes in the model's chat template when the tokenizer has one
(``--ignore-chat-template``, alias ``--no-chat``, sends it as it is). Before a prefill the user is
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
import sys
from pathlib import Path
from typing import Any

from cachecd.cli_help import count, number
from cachecd.config import add_common_arguments
from cachecd_engine.run_mlx import add_generate_flags, call_main
from cachecd_engine.run_session import cold_cost_notice

__all__ = ["cold_cost_notice", "load", "run"]  # cold_cost_notice: cachecd openai's too

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
    p = sub.add_parser("run", help="generate through the daemon (mlx_lm.generate's flags)")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--prompt", "-p", required=True,
                   help="the prompt; '-' reads it from standard input")
    p.add_argument("--max-tokens", "-m", "--max-new", dest="max_tokens", type=count(1), default=64,
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
    add_generate_flags(p)
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


def run(args: argparse.Namespace) -> int:
    from cachecd_client import resolve_model
    from cachecd_engine.kernels import compiling_notice

    args.model = resolve_model(args.model, args.socket)
    daemon_answers(args.socket)  # before mlx loads: no daemon is a one-line error at once
    compiling = compiling_notice()  # asked before the load, which may compile a kernel too

    from cachecd_engine.pipeline import launched_group, shared_seed
    from cachecd_engine.run_session import RunSession

    group = launched_group()
    # mlx_lm.generate's main() seeds before it loads, as it must: building the model draws from
    # the PRNG (its layers' initial weights). Pipelined, every rank samples with one seed.
    if args.seed is None and group is not None:
        args.seed = shared_seed(group)
    session = RunSession(args, group, load, engine_options(args))
    try:
        session.compiling = compiling
        call_main(session.main_args(), session.load, session.generate)
        settle()
        records = session.records
        if group is not None:
            records = merge_ranks(group, records)
    finally:
        session.close()
    if group is None or group.rank() == 0:
        session.summary(records)
    return 0


def daemon_answers(socket: str | None) -> None:
    """``DaemonUnavailable`` now if nothing answers on ``socket`` (a pipelined rank's
    ``{rank}`` socket is its own, checked when that rank loads)."""
    from cachecd_client import Client

    if "{rank}" in str(socket or ""):
        return
    with Client(socket, timeout=10) as client:
        client.health()


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


def _size(value: str, flag: str) -> int | None:
    from cachecd.config import parse_size

    return None if value == "auto" else parse_size(value, flag)
