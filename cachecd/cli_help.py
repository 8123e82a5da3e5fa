"""How ``cachecd --help`` reads: every option's default shown, the commands in groups, and each
command's exit codes.

The groups put what a user runs first (use, cache, service) and the developer tools last.
A command no group names is still listed, under "more", so none is ever hidden.

Exit codes mean one thing each (``errors.exit_codes`` has them; docs/daemon.md has the table).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("use", ("doctor", "plan", "setup", "run", "openai", "demo")),
    ("cache", ("status", "warm", "coverage", "pin", "unpin", "evict", "remove", "fsck")),
    ("service", ("serve", "stop", "service")),
    ("developer tools", ("manifest", "hub", "tiny-model")),
)
_SAYS_DEFAULT = re.compile(r"\(default|default:|%\(default|\(the default\)|; default ", re.I)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, with ``(default: X)`` after an option's help unless the help says
    its default already or there is none to show (a flag that is off, an unset option whose help
    says what happens without it)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Lines that start with two spaces (a table's rows) keep their place; the rest flows."""
        import textwrap

        out = []
        for line in text.splitlines():
            if line.startswith("  "):
                body = line.lstrip()
                lead = " " * (len(line) - len(body) + body.find("  ") + 2)
                out.append(textwrap.fill(line, width, initial_indent=indent,
                                         subsequent_indent=indent + lead))
            else:
                out.append(super()._fill_text(line, width, indent))
        return "\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or _SAYS_DEFAULT.search(text):
            return text
        d = action.default
        if d is None or d is False or d is argparse.SUPPRESS or d in ("", [], {}):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help, and its subcommands' help, uses :class:`HelpFormatter`, and
    whose unknown arguments are refused by the (sub)command that got them: its own usage, and the
    closest of its options."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        # argparse hands a subcommand's leftovers up to the top parser, which would print the
        # top-level usage; refusing them here prints the usage of the command they were given to.
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(unknown_arguments(self, extras))
        return parsed, extras


def unknown_arguments(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's message for ``extras``, with the closest option of ``parser`` to each unknown
    flag (``--max-token=5``: ``--max-tokens``)."""
    import difflib

    # Compared without the dashes, which every long option shares.
    known = {s[2:]: s for s in parser._option_string_actions if s.startswith("--")}
    hints = []
    for extra in extras:
        flag = extra.split("=", 1)[0]
        close = difflib.get_close_matches(flag[2:], known, n=1) if flag.startswith("--") else []
        if close:
            hints.append(f"did you mean {known[close[0]]}?")
    return "; ".join([f"unrecognized arguments: {' '.join(extras)}", *hints])


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """``-v``/``--verbose`` (debug logging) after any subcommand too, as before it, where the
    command has no option of that name of its own (``status -v`` lists pins; ``run --verbose`` is
    mlx_lm.generate's). Unset unless given, so ``cachecd -v CMD`` is not undone by CMD's default."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for child in action.choices.values():
            free = [s for s in ("-v", "--verbose") if s not in child._option_string_actions]
            if free:
                child.add_argument(*free, dest="debug", action="store_true",
                                   default=argparse.SUPPRESS, help="debug logging on stderr")
            add_debug_flag(child)


ExitTable = Callable[[str], list[tuple[int, str]]]


def exit_epilog(rows: list[tuple[int, str]]) -> str:
    width = max(len(str(code)) for code, _ in rows)
    return "exit codes:\n" + "\n".join(f"  {code:>{width}}  {what}" for code, what in rows)


def add_exit_codes(parser: argparse.ArgumentParser, table: ExitTable, path: str = "") -> None:
    """Each command's (and subcommand's) ``--help`` ends with its exit codes, ``table(command)``
    (``errors.exit_codes``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                command = f"{path} {name}".strip()
                child.epilog = "\n".join(filter(None, (child.epilog, exit_epilog(table(command)))))
                add_exit_codes(child, table, command)


def group_commands(parser: argparse.ArgumentParser, sub: Any) -> None:
    """List ``sub``'s commands under GROUPS' titles instead of one block of positionals."""
    entries = {a.dest: a for a in sub._choices_actions}  # argparse's one row per command
    parser._positionals._group_actions.remove(sub)
    for title, names in (*GROUPS, ("more", tuple(entries))):
        rows = [entries.pop(n) for n in names if n in entries]
        if rows:
            parser.add_argument_group(title)._group_actions.extend(rows)


# Argument types: every command checks its numbers as argparse parses them, before any work, and
# a bad one ends in argparse's one line naming the flag ("argument --prefill-step-size: ...").
def count(low: int = 1, high: int | None = None) -> Callable[[str], int]:
    """An integer from ``low`` (and up to ``high``) for ``type=``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        return _within(value, low, high)

    parse.__name__ = "count"
    return parse


def number(low: float = 0.0, high: float | None = None) -> Callable[[str], float]:
    """A number from ``low`` (and up to ``high``) for ``type=``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value != value:  # NaN passes every comparison
            raise argparse.ArgumentTypeError("nan is not a number")
        return _within(value, low, high)

    parse.__name__ = "number"
    return parse


def _within(value: Any, low: Any, high: Any) -> Any:
    if value < low or (high is not None and value > high):
        wanted = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise argparse.ArgumentTypeError(f"must be {wanted}, not {value}")
    return value
