"""``cachecd openai``: the command line of the OpenAI-compatible server (``openai_server``).

The flags are mlx_lm.server's names and defaults for what a user of a streamed model sets; the
rest of mlx_lm.server's settings keep its defaults (``server_args``). Importing this module does
not import mlx: ``cachecd --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from cachecd_engine.run import MODEL_HELP, add_engine_flags, add_trust_flag, engine_options


def register(sub: Any) -> None:
    p = sub.add_parser("openai", help="an OpenAI-compatible HTTP server (mlx-lm's) through the daemon")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free one)")
    add_engine_flags(p)
    p.add_argument("--max-tokens", type=int, default=512,
                   help="tokens per answer when a request does not say (default 512)")
    p.add_argument("--temp", type=float, default=0.0, help="default temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="default nucleus sampling top-p")
    p.add_argument("--top-k", type=int, default=0, help="default top-k (0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="default min-p (0: off)")
    p.add_argument("--chat-template", default="", help="a chat template to use instead of the model's (default: the model's)")
    p.add_argument("--chat-template-args", type=json.loads, default={},
                   help="JSON arguments for apply_chat_template, e.g. '{\"thinking\": false}' "
                        "(default: none)")
    add_trust_flag(p)
    p.add_argument("--allowed-origins", type=lambda s: s.split(","), default=[],
                   help="browser origins allowed to use the server, comma-separated ('*': any); "
                        "default none")
    p.add_argument("--prefill-step-size", type=int, default=2048,
                   help="prompt tokens per prefill step (default 2048)")
    p.add_argument("--prompt-cache-size", type=int, default=10,
                   help="distinct KV caches kept for prompt reuse (default 10)")
    p.set_defaults(func=run)


def server_args(args: argparse.Namespace) -> argparse.Namespace:
    """What mlx-lm's server reads from its command line: ours where ``cachecd openai`` has the flag,
    mlx_lm.server's defaults elsewhere (tests/unit/test_openai_cli.py holds them equal)."""
    return argparse.Namespace(
        model=args.model, adapter_path=None, host=args.host, port=args.port,
        allowed_origins=args.allowed_origins, draft_model=None, num_draft_tokens=3,
        trust_remote_code=args.trust_remote_code, log_level="INFO",
        chat_template=args.chat_template, use_default_chat_template=False, temp=args.temp,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, max_tokens=args.max_tokens,
        chat_template_args=args.chat_template_args, decode_concurrency=32, prompt_concurrency=8,
        prefill_step_size=args.prefill_step_size, prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=None, kv_bits=None, kv_group_size=64, quantized_kv_start=5000,
        pipeline=False)


def run(args: argparse.Namespace) -> int:
    from cachecd_client import resolve_model
    from cachecd_engine.openai_server import serve

    args.model = resolve_model(args.model, args.socket)
    serve(server_args(args), engine_options(args))
    # Once it has generated, an MLX process that ran mlx-lm's server aborts in its exit-time
    # destructors ("terminate called without an active exception", exit 134; the same with
    # mlx_lm.server on Ctrl-C, mlx 0.32, CPU). Everything of ours is closed by now: skip them.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)
