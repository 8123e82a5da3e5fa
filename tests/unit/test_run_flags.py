"""`cachecd run`'s options are mlx_lm.generate's: each of its parser's options is one of ours with
the same option strings, type, nargs and default (but the two defaults cachecd sets on purpose),
or one refused with a reason (``run_mlx.REFUSED``)."""

from __future__ import annotations

import argparse
import importlib

from cachecd.cli import build_parser
from cachecd_engine.run_mlx import REFUSED, Refused

# cachecd's on purpose: a prompt is required (mlx-lm's default text is "hello"), 64 new tokens.
OUR_DEFAULTS = {"prompt": None, "max_tokens": 64}
SAMPLES = ["0", "1", "0.5", "F", "false", "True", "t", "x"]
# Values mlx-lm takes that cannot make a run (no token to generate): ours refuses them as the
# command line is parsed (issue 45's input checks), with the flag named.
OUR_REFUSALS = {("max_tokens", "0"), ("prefill_step_size", "0")}


def _run_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def _reads(kind: object, text: str) -> object:
    try:
        return kind(text) if callable(kind) else text
    except (ValueError, argparse.ArgumentTypeError):  # argparse refuses the value either way
        return "refused"


def test_every_mlx_lm_generate_option_is_ours() -> None:
    theirs = importlib.import_module("mlx_lm.generate").setup_arg_parser()
    ours = {a.dest: a for a in _run_parser()._actions}
    refused = {flags[0] for flags, _, _ in REFUSED}
    for action in theirs._actions:
        if action.dest == "help":
            continue
        mine = ours.get(action.dest)
        assert mine is not None, f"{action.option_strings} missing from cachecd run"
        assert set(action.option_strings) <= set(mine.option_strings), action.dest
        assert mine.default == OUR_DEFAULTS.get(action.dest, action.default), action.dest
        if isinstance(mine, Refused):  # refused when given, whatever its value
            assert action.option_strings[0] in refused and mine.why
            continue
        assert mine.nargs == action.nargs, action.dest
        assert [_reads(mine.type, s) for s in SAMPLES] == \
            ["refused" if (action.dest, s) in OUR_REFUSALS
             else _reads(action.type, s) for s in SAMPLES], action.dest
        assert type(mine) is type(action), action.dest
