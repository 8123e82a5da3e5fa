"""The ``cachecd`` command line. Each command lives in the module that owns it.

A command module exposes ``register(sub)``: it adds its parser to the subparsers and sets
``func`` (``args -> int`` exit code). Heavy imports (mlx, aiohttp) stay inside the functions
so ``cachecd --help`` and the client-side commands start fast.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import sys
import traceback

from cachecd import __version__
from cachecd.cli_help import Parser, group_commands
from cachecd.hub_errors import translate

# Modules that own commands; `--help` lists the commands in cli_help's groups.
_COMMAND_MODULES: tuple[str, ...] = (
    "cachecd.testbed.tiny_cli",
    "cachecd.testbed.hub_cli",
    "cachecd.manifest.cli",
    "cachecd.setup.stream",
    "cachecd.daemon.serve",
    "cachecd.ctl.cache",
    "cachecd.ctl.remove",
    "cachecd.service.cli",
    "cachecd_engine.run",
    "cachecd_engine.openai_cli",
    "cachecd.testbed.demo",
    "cachecd.ctl.warm",
    "cachecd.ctl.coverage",
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="cachecd", description="Run a frontier MoE model on a machine too small for it.")
    parser.add_argument("--version", action="version", version=f"cachecd {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a broken import inside the module must not be hidden
                raise
            continue
        module.register(sub)
    group_commands(parser, sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # transformers warns on every tokenizer load that it does not know model_type kimi_k3; the
    # load works (mlx-lm's loader is used), so keep the user's terminal for real problems.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    # huggingface_hub's HTTP client logs every request at INFO; that is noise on a terminal.
    for noisy in ("httpx", "httpx2", "httpcore", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `cachecd ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except Exception as exc:
        typed = translate(exc)  # the Hub's and the network's errors, as cachecd's
        if typed is not None:
            line = f"{typed.code}: {typed.message}"
        elif isinstance(exc, OSError) and exc.filename:  # a path the user gave that cannot be used
            name = errno.errorcode.get(exc.errno or 0, "os_error").lower()
            line = f"{name}: {exc.filename}: {exc.strerror} (cachecd -v shows where)"
        else:
            raise
        if args.verbose:
            traceback.print_exception(exc)
        print(f"cachecd: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
