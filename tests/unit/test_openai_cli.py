"""The mlx-lm surfaces cachecd mirrors stay mlx-lm's: ``cachecd_engine.load``'s signature, the
settings ``cachecd openai`` hands mlx-lm's server, and ``cachecd run``'s sampling defaults."""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys

import pytest

from cachecd.cli import build_parser


def test_load_takes_mlx_lm_loads_arguments_then_engine_keywords() -> None:
    import mlx_lm

    import cachecd_engine

    ours = list(inspect.signature(cachecd_engine.load).parameters.values())
    theirs = list(inspect.signature(mlx_lm.load).parameters.values())
    assert [(p.name, p.default, p.kind) for p in ours[: len(theirs)]] == [
        (p.name, p.default, p.kind) for p in theirs]
    extra = ours[len(theirs):]
    assert {p.name for p in extra} == {"socket", "ram_bytes", "expert_memory", "stats", "trace",
                                       "prefetch", "speculate", "pipeline"}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)


def mlx_lm_server_defaults(monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The namespace mlx_lm.server's own command line builds with no flags."""
    import mlx_lm.server

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(mlx_lm.server, "run", lambda host, port, provider: seen.append(provider))
    monkeypatch.setattr(mlx_lm.server, "ModelProvider", lambda args: args)
    monkeypatch.setattr(sys, "argv", ["mlx_lm.server"])
    mlx_lm.server.main()
    return seen[0]


def test_openai_hands_mlx_lms_server_its_own_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from cachecd_engine.openai_cli import server_args

    theirs = vars(mlx_lm_server_defaults(monkeypatch))
    ours = vars(server_args(build_parser().parse_args(["openai", "--model", "org/name"])))
    assert set(ours) == set(theirs)
    differ = {k: (ours[k], theirs[k]) for k in theirs if ours[k] != theirs[k]}
    # The model is ours to name; browser origins are refused unless allowed (mlx-lm: "*").
    assert differ == {"model": ("org/name", None), "allowed_origins": ([], ["*"])}


def test_run_samples_as_mlx_lm_generate_by_default() -> None:
    # the module: mlx_lm's package attribute `generate` is the function
    generate = importlib.import_module("mlx_lm.generate")

    args = build_parser().parse_args(["run", "--model", "org/name", "--prompt", "x"])
    assert (args.temp, args.top_p, args.top_k, args.min_p, args.seed, args.prefill_step_size) == (
        generate.DEFAULT_TEMP, generate.DEFAULT_TOP_P, generate.DEFAULT_TOP_K,
        generate.DEFAULT_MIN_P, generate.DEFAULT_SEED, generate.DEFAULT_PREFILL_STEP_SIZE)
    assert args.temp == 0.0  # greedy
    alias = build_parser().parse_args(["run", "--model", "o/n", "--prompt", "x", "--max-new", "7"])
    assert alias.max_tokens == 7
