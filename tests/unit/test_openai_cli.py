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
                                       "prefetch", "speculate", "pipeline", "layer_major"}
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


def test_openai_takes_every_mlx_lm_server_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of mlx_lm.server's options is one of `cachecd openai`'s, with the same default; what
    cannot apply to a model is refused when it loads (openai_server.refuse_what_cannot_apply)."""
    import mlx_lm.server

    parsers: list[argparse.ArgumentParser] = []
    parse = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, *a: object, **k: object) -> argparse.Namespace:
        parsers.append(self)
        return parse(self, [])

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(mlx_lm.server, "run", lambda *a, **k: None)
    mlx_lm.server.main()
    monkeypatch.undo()
    theirs = {o for a in parsers[0]._actions for o in a.option_strings}
    ours_parser = next(child for path, child in _parsers(build_parser()) if path == "openai")
    ours = {o for a in ours_parser._actions for o in a.option_strings}
    assert theirs - ours == set(), sorted(theirs - ours)


def _parsers(parser: argparse.ArgumentParser, path: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                out += _parsers(child, f"{path} {name}".strip())
    return out


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
