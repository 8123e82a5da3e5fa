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
from cachecd.cli_help import Parser, add_debug_flag, add_exit_codes, group_commands
from cachecd.errors import EXIT_INTERRUPTED, EXIT_USAGE, exit_codes
from cachecd.hub_errors import translate
from cachecd.secrets import install as scrub_logs
from cachecd.secrets import scrub

# Modules that own commands; `--help` lists the commands in cli_help's groups.
_COMMAND_MODULES: tuple[str, ...] = (
    "cachecd.testbed.tiny_cli",
    "cachecd.lanhub.cli",
    "cachecd.manifest.cli",
    "cachecd.setup.stream",
    "cachecd.daemon.serve",
    "cachecd.ctl.cache",
    "cachecd.ctl.remove",
    "cachecd.ctl.stop",
    "cachecd.service.cli",
    "cachecd_engine.run",
    "cachecd_engine.openai_cli",
    "cachecd.testbed.demo",
    "cachecd.ctl.warm",
    "cachecd.ctl.coverage",
    "cachecd.plan.doctor",
    "cachecd.plan.plan",
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="cachecd", description="Run a frontier MoE model on a machine too small for it.")
    parser.add_argument("--version", action="version", version=f"cachecd {__version__}")
    parser.add_argument("-v", "--verbose", dest="debug", action="store_true",
                        help="debug logging on stderr (before or after the command)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a broken import inside the module must not be hidden
                raise
            continue
        module.register(sub)
    add_debug_flag(parser)
    add_exit_codes(parser, exit_codes)
    group_commands(parser, sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # transformers warns on every tokenizer load that it does not know model_type kimi_k3; the
    # load works (mlx-lm's loader is used), so keep the user's terminal for real problems.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=log_level(args), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    scrub_logs()  # no token in a log line or a traceback, whatever carried it there
    # huggingface_hub's HTTP client logs every request at INFO; that is noise on a terminal.
    for noisy in ("httpx", "httpx2", "httpcore", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `cachecd ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except Exception as exc:
        typed = translate(exc)  # the Hub's and the network's errors, as cachecd's
        if typed is not None:
            line, code = f"{typed.code}: {typed.message}", typed.exit_code
        elif isinstance(exc, OSError) and exc.filename:  # a path the user gave that cannot be used
            name = errno.errorcode.get(exc.errno or 0, "os_error").lower()
            line = f"{name}: {exc.filename}: {exc.strerror} (cachecd -v shows where)"
            code = 1
        else:
            raise
        if args.debug:
            traceback.print_exception(exc)
        print(f"cachecd: {scrub(line)}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        if getattr(args, "resumes", False):
            print(f"\ncachecd: interrupted; run `{rerun(argv)}` again to resume where it "
                  "stopped (what is fetched and verified is kept)", file=sys.stderr)
        return EXIT_INTERRUPTED


def rerun(argv: list[str] | None) -> str:
    """The command line as the user typed it, quoted for a shell."""
    import shlex

    return shlex.join(["cachecd", *(sys.argv[1:] if argv is None else argv)])


def log_level(args: argparse.Namespace) -> int:
    """DEBUG with -v; INFO on a terminal; else WARNING, so that a command whose stderr goes to a
    file or a pipe writes what went wrong there, not its progress. A command that is a server
    (``serve``, ``hub serve``, ``openai``) sets its own level: its log is what it writes."""
    if args.debug:
        return logging.DEBUG
    return logging.INFO if sys.stderr.isatty() else logging.WARNING


if __name__ == "__main__":
    sys.exit(main())
