"""``cachecd openai``: the command line of the OpenAI-compatible server (``openai_server``).

Every mlx_lm.server flag is here, with its name and default (``tests/unit/test_openai_cli.py``
holds them equal); the server refuses, with the reason, what cannot apply to the model it loads
(``openai_server.refusals``). Importing this module does not import mlx: ``cachecd --help`` stays
fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from cachecd.cli_help import count, number
from cachecd.config import parse_size
from cachecd.errors import EXIT_INTERRUPTED, CachecdError
from cachecd_engine.run import MODEL_HELP, add_engine_flags, add_trust_flag, engine_options


def register(sub: Any) -> None:
    p = sub.add_parser("openai", help="an OpenAI-compatible HTTP server (mlx-lm's) through the daemon")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=count(0, 65535), default=8080, help="port (default 8080; 0: any free one)")
    add_engine_flags(p)
    p.add_argument("--max-tokens", type=count(1), default=512,
                   help="tokens per answer when a request does not say (default 512)")
    p.add_argument("--temp", type=number(0), default=0.0, help="default temperature (0: greedy)")
    p.add_argument("--top-p", type=number(0, 1), default=1.0, help="default nucleus sampling top-p")
    p.add_argument("--top-k", type=count(0), default=0, help="default top-k (0: off)")
    p.add_argument("--min-p", type=number(0, 1), default=0.0, help="default min-p (0: off)")
    p.add_argument("--chat-template", default="", help="a chat template to use instead of the model's (default: the model's)")
    p.add_argument("--chat-template-args", type=json.loads, default={},
                   help="JSON arguments for apply_chat_template, e.g. '{\"thinking\": false}' "
                        "(default: none)")
    add_trust_flag(p)
    p.add_argument("--allowed-origins", type=lambda s: s.split(","), default=[],
                   help="browser origins allowed to use the server, comma-separated ('*': any); "
                        "default none")
    p.add_argument("--prefill-step-size", type=count(1), default=2048,
                   help="prompt tokens per prefill step (default 2048)")
    p.add_argument("--prompt-cache-size", type=count(0), default=10,
                   help="distinct KV caches kept for prompt reuse (default 10)")
    _add_mlx_lm_server_flags(p)
    p.set_defaults(func=run)


def _add_mlx_lm_server_flags(p: argparse.ArgumentParser) -> None:
    """The rest of mlx_lm.server's flags, with its defaults."""
    p.add_argument("--prompt-cache-bytes", type=lambda v: parse_size(v, "--prompt-cache-bytes"),
                   metavar="SIZE", help="bound on the bytes of the KV caches kept for prompt "
                   "reuse, e.g. 4GiB (default: none, as mlx_lm.server: only --prompt-cache-size)")
    p.add_argument("--decode-concurrency", type=count(1), default=32,
                   help="requests decoded together in one batch (default 32)")
    p.add_argument("--prompt-concurrency", type=count(1), default=8,
                   help="prompts prefilled together in one batch (default 8)")
    p.add_argument("--kv-bits", type=int, default=None,
                   help="quantize the KV cache to this many bits (4 or 8; default: none); "
                        "refused for a model whose attention cannot read a quantized cache "
                        "(kimi_k3's), as mlx-lm fails on it")
    p.add_argument("--kv-group-size", type=count(1), default=64,
                   help="group size of the KV cache quantization (default 64)")
    p.add_argument("--quantized-kv-start", type=count(0), default=5000,
                   help="token position where KV cache quantization starts (default 5000)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="the server's logging (default INFO)")
    p.add_argument("--use-default-chat-template", action="store_true",
                   help="use the tokenizer's default chat template when the model has none")
    p.add_argument("--adapter-path", help="an adapter (mlx_lm.lora's) on the resident weights; "
                   "one with routed-expert weights is refused (default: none)")
    p.add_argument("--draft-model", help="a small model for speculative decoding (loaded with "
                   "mlx_lm.load); refused for a model whose caches cannot be trimmed, as "
                   "speculative decoding needs (K3's KDA layers; default: none)")
    p.add_argument("--num-draft-tokens", type=count(1), default=3,
                   help="tokens the draft model proposes a step (default 3)")
    p.add_argument("--pipeline", action="store_true",
                   help="accepted for mlx_lm.server's command lines: under mlx.launch cachecd "
                        "always pipelines the layers over the ranks, each streaming its own "
                        "layers' experts (tensor parallelism would split every expert)")


def server_args(args: argparse.Namespace) -> argparse.Namespace:
    """What mlx-lm's server reads from its command line (tests/unit/test_openai_cli.py holds the
    defaults equal to mlx_lm.server's)."""
    keys = ("model", "adapter_path", "host", "port", "allowed_origins", "draft_model",
            "num_draft_tokens", "trust_remote_code", "log_level", "chat_template",
            "use_default_chat_template", "temp", "top_p", "top_k", "min_p", "max_tokens",
            "chat_template_args", "decode_concurrency", "prompt_concurrency",
            "prefill_step_size", "prompt_cache_size", "prompt_cache_bytes", "kv_bits",
            "kv_group_size", "quantized_kv_start", "pipeline")
    return argparse.Namespace(**{k: getattr(args, k) for k in keys})


def run(args: argparse.Namespace) -> int:
    from cachecd_client import resolve_model
    from cachecd_engine.openai_server import serve

    args.model = resolve_model(args.model, args.socket)
    logging.getLogger().setLevel(logging.DEBUG if args.debug else args.log_level)
    try:
        serve(server_args(args), engine_options(args))
    except CachecdError as exc:  # printed as cli.main would, then the exit below
        print(f"cachecd: {exc.code}: {exc.message}", file=sys.stderr)
        code = exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        code = EXIT_INTERRUPTED
    else:
        code = 0
    # Once its generation thread has used MLX (it loads the model), an MLX process that ran
    # mlx-lm's server aborts in its exit-time destructors ("terminate called without an active
    # exception", exit 134; the same with mlx_lm.server on Ctrl-C, mlx 0.32, CPU). Everything
    # of ours is closed by now: skip them.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
