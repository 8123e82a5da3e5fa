"""``cachecd hub serve DIR``: the command's parser and entry. ``server`` (aiohttp) loads only
when the command runs, so building the CLI's parser stays light."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any

from cachecd.errors import InvalidRequest


def _cmd_serve(args: argparse.Namespace) -> int:
    if not args.dir.is_dir():
        raise InvalidRequest(f"{args.dir} is not a directory: give the folder that holds org/name/")
    for name in ("resolve_limit", "resolve_limit_signed", "limit_window"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            flag = "--" + name.replace("_", "-")
            raise InvalidRequest(f"{flag} must be positive, got {getattr(args, name)}: give "
                                 "a number above 0, or leave the limit out (no limit)")
    if args.no_xet and args.xet_fault:
        raise InvalidRequest("--xet-fault needs Xet served: drop --no-xet")
    if args.xet_fault:
        from cachecd.lanhub.xet_faults import XetFaults

        try:
            for spec in args.xet_fault:
                XetFaults().set(spec)
        except ValueError as exc:
            raise InvalidRequest(f"--xet-fault: {exc}") from exc
    from cachecd.lanhub.server import serve_until_signal

    # A server: its log is what it writes, on a terminal or not (cli quiets other commands).
    logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.INFO)

    return asyncio.run(serve_until_signal(args))


def register(sub: Any) -> None:
    hub = sub.add_parser("hub", help="a Hugging Face Hub compatible endpoint over a folder")
    hub.set_defaults(func=lambda _args: (hub.print_help(), 2)[1])
    hub_sub = hub.add_subparsers(dest="hub_command", metavar="SUBCOMMAND")
    serve = hub_sub.add_parser(
        "serve", help="serve DIR/{org}/{name}/... as model repos, DIR/datasets/... as datasets")
    serve.add_argument("dir", type=Path, metavar="DIR",
                       help="the folder: DIR/ORG/NAME/ is the model repo ORG/NAME")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    serve.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN' (default: no token needed)")
    serve.add_argument(
        "--url-ttl",
        type=float,
        default=None,
        help="seconds a signed download URL stays valid (default: 3600, an hour, as the Hub's)",
    )
    serve.add_argument(
        "--resolve-limit", type=int, default=None, metavar="N",
        help="answer 429 past N /resolve requests per window from one anonymous caller, with "
             "the Hub's RateLimit headers (the Hub: 3000; default: no limit)")
    serve.add_argument(
        "--resolve-limit-signed", type=int, default=None, metavar="N",
        help="the same for a caller that sends a token (the Hub: 5000; default: --resolve-limit)")
    serve.add_argument(
        "--limit-window", type=float, default=300.0, metavar="SECONDS",
        help="the window those limits count over (default: 300, the Hub's 5 minutes)")
    serve.add_argument(
        "--prehash", action="store_true", help="hash every repo in the background at start"
    )
    serve.add_argument(
        "--gated", action="append", metavar="ORG/NAME",
        help="answer for this repo as the Hub does for a gated repo the caller has no access to "
             "(403 GatedRepo); repeatable (default: none)",
    )
    _xet_options(serve)
    serve.set_defaults(func=_cmd_serve)


def _xet_options(serve: Any) -> None:
    serve.add_argument(
        "--no-xet", action="store_true",
        help="serve the LFS route only, as the Hub does for a repo not on Xet (default: large "
             "files are also served through Xet: X-Xet-Hash, xet-read-token, a CAS under /_xet)")
    serve.add_argument(
        "--xet-scheme", choices=("lz4", "none", "bg4", "mixed"), default="lz4",
        help="how chunks are stored in xorbs: LZ4 where it shrinks them, none, byte grouping "
             "then LZ4, or mixed (each scheme in turn, for tests) (default: lz4)")
    serve.add_argument(
        "--xet-token-ttl", type=float, default=3600.0, metavar="SECONDS",
        help="how long a Xet CAS token lives (default: 3600)")
    serve.add_argument(
        "--xet-url-ttl", type=float, default=3600.0, metavar="SECONDS",
        help="how long a signed xorb URL lives; 403 after (default: 3600)")
    serve.add_argument(
        "--xorb-bytes", type=int, default=64 * 1024 * 1024, metavar="N",
        help="the most bytes a xorb holds (default: the spec's 64 MiB; less gives a small file "
             "several xorbs, for tests)")
    serve.add_argument(
        "--xet-fault", action="append", metavar="NAME[=VALUE]",
        help="for tests of a Xet client: flip_xorb_byte, bad_chunk_header, proof_node_flip, "
             "proof_offset=N, swap_xorb, expired_url, expired_token, times=N (how many "
             "answers); repeatable (default: none)")
