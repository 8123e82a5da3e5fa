"""Every option of every command says what it does and what it is when not given, and
``cachecd --help`` lists the commands in groups, what a user runs first."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

from cachecd.cli import build_parser
from cachecd.cli_help import GROUPS
from tests.harness import run_cli

_SKIP = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def parsers(parser: argparse.ArgumentParser, path: str = "cachecd"
            ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from parsers(child, f"{path} {name}")


def option_problems(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """An option without help, or one taking a value whose help (as shown) has no default."""
    out = []
    formatter = parser._get_formatter()
    # One of these must be given: none has a default to show.
    one_of = {a for g in parser._mutually_exclusive_groups if g.required for a in g._group_actions}
    for a in parser._actions:
        if isinstance(a, _SKIP) or a.help == argparse.SUPPRESS:  # not shown: a refused option
            continue
        where = f"{path} {'/'.join(a.option_strings) or a.dest}"
        if not a.help:
            out.append(f"{where}: no help")
        elif a.option_strings and not a.required and a.nargs != 0 and a not in one_of \
                and "default" not in (formatter._get_help_string(a) or "").lower():
            out.append(f"{where}: its help does not say the default")
    return out


def test_every_option_has_help_with_its_default() -> None:
    problems = [p for path, parser in parsers(build_parser()) for p in option_problems(parser, path)]
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_missing_help() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--a", default=3)
    p.add_argument("--b", help="a value")
    p.add_argument("--c", action="store_true", help="a flag")
    p.add_argument("d")
    assert option_problems(p, "x") == ["x --a: no help", "x --b: its help does not say the default",
                                       "x d: no help"]


def test_help_shows_defaults() -> None:
    out = run_cli("tiny-model", "--help").stdout
    assert re.search(r"--experts EXPERTS\s+experts per MoE layer \(default: 32\)", out), out
    out = run_cli("hub", "serve", "--help").stdout
    assert "(default: 127.0.0.1)" in out, out


def test_commands_are_grouped_user_first() -> None:
    out = run_cli("--help").stdout
    titles = [f"\n{title}:\n" for title, _ in GROUPS]
    at = [out.find(t) for t in titles]
    assert all(i >= 0 for i in at) and at == sorted(at), out
    assert "\nmore:\n" not in out, "a command belongs to no group in cli_help.GROUPS"
    assert "positional arguments" not in out
    for (title, names), start, end in zip(GROUPS, at, [*at[1:], len(out)], strict=True):
        section = out[start:end]
        for name in names:
            assert re.search(rf"^  {re.escape(name)}\s", section, re.M), (title, name, out)


def test_building_the_command_line_loads_no_heavy_library() -> None:
    """cli.py's promise: `cachecd --help`, `status` and the other client-side commands do not
    pay for aiohttp, mlx or the checkpoint writers; each command loads them when it runs."""
    import subprocess
    import sys

    heavy = ("aiohttp", "mlx", "mlx_lm", "safetensors", "transformers", "lmdb",
             "cachecd.testbed.tiny_k2", "cachecd.lanhub.server")
    probe = ("import sys; from cachecd.cli import build_parser; build_parser(); "
             f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    assert out.strip() == "[]", out


def test_hub_serve_help_names_the_url_lifetime_the_server_uses() -> None:
    from cachecd.lanhub.app import DEFAULT_URL_TTL_S

    out = run_cli("hub", "serve", "--help").stdout
    assert f"(default: {DEFAULT_URL_TTL_S:.0f}," in " ".join(out.split())


def test_every_command_says_its_exit_codes_one_meaning_each() -> None:
    from cachecd.errors import exit_codes

    for path, parser in parsers(build_parser()):
        if path == "cachecd":
            continue
        command = path.removeprefix("cachecd ")
        text = parser.format_help()
        assert "\nexit codes:\n" in text, path
        rows = exit_codes(command)
        codes = [code for code, _ in rows]
        assert len(codes) == len(set(codes)) and {0, 2, 130} <= set(codes), (path, rows)
        for code, _ in rows:
            assert re.search(rf"^\s+{code}  \S", text.split("\nexit codes:\n")[1], re.M), (path, code)
    assert {c for c, _ in exit_codes("fsck")} == {0, 1, 2, 4, 5, 6, 130}
    assert 3 in {c for c, _ in exit_codes("status")} and 3 in {c for c, _ in exit_codes("warm")}
    assert 6 in {c for c, _ in exit_codes("serve")}


def test_readme_has_the_exit_code_table() -> None:
    from pathlib import Path

    from cachecd.errors import exit_codes

    readme = (Path(__file__).resolve().parents[2] / "docs" / "daemon.md").read_text()
    table = readme.split("### Exit codes", 1)[1].split("\n#", 1)[0]
    for command in ("setup", "status", "fsck", "serve", "warm", "run"):
        for code, _ in exit_codes(command):
            assert re.search(rf"^\| `?{code}`? \|", table, re.M), (command, code)
    assert "`cachecd fsck`" in table
