"""Secrets: one type that holds a token, one scrubber that takes tokens out of text.

Invariants:
- Every token cachecd holds (the Hub's, the LAN share's, a peer's, ``hub serve``'s) is a
  ``Secret``: its ``repr`` and ``str`` are ``Secret('***')``, so a token that ends up in a log
  line, an f-string or an exception's repr shows nothing. ``reveal()`` is the one way to the
  value, used where a header is built or a token compared.
- A ``Secret``'s value is registered here, and ``scrub`` replaces every registered value
  wherever it appears, whatever object carried it into the text (an aiohttp error's repr with
  the request's headers, a URL, a traceback).
- ``scrub`` also removes what a token looks like without being registered: ``Bearer`` values,
  ``Authorization`` / ``Cookie`` header values in any repr (``'Authorization': '...'``,
  ``Authorization: ...``), Hub tokens (``hf_...``), and signed-URL query parameters
  (``Signature=``, ``X-Amz-Signature=``, ``Policy=``, ``Key-Pair-Id=``, ``token=``, ...).
- ``install()`` puts ``ScrubFilter`` on every handler of the root logger (a filter on a handler
  sees records propagated from every logger; one on a logger would not), and scrubs what
  ``sys.excepthook`` and ``threading.excepthook`` print. The daemon and the command line call it
  once their handlers are set; ``errors.CachecdError`` scrubs every message it is given, so the
  wire form, the client's errors and the command line's error line are scrubbed too.

This module imports nothing of cachecd: it sits below ``errors``.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from typing import Any

REDACTED = "***"
# Shorter values are not registered: replacing "abc" everywhere would mangle text, and a token
# that short is refused by config anyway (``TOKEN_MIN_BITS``).
_MIN_REGISTERED = 8
_registered: set[str] = set()
_lock = threading.Lock()

_SIGNED_PARAMS = ("signature", "x-amz-signature", "x-amz-credential", "x-amz-security-token",
                  "policy", "key-pair-id", "token", "access_token", "sig", "x-goog-signature",
                  "x-goog-credential", "x-goog-security-token", "se", "sv")
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # A header's value in a dict's or multidict's repr, or a raw header line.
    (re.compile(r"""(?i)((?:proxy-)?authorization|(?:set-)?cookie|x-amz-security-token)"""
                r"""(['"]?\s*[:=]\s*)(['"]?)([^'"\r\n]*)"""), r"\1\2\3" + REDACTED),
    (re.compile(r"(?i)\b(bearer)(\s+)[A-Za-z0-9._~+/=\-]{12,}"), r"\1\2" + REDACTED),
    (re.compile(r"hf_[A-Za-z0-9]{30,}"), "hf_" + REDACTED),
    (re.compile(r"(?i)([?&;](?:" + "|".join(map(re.escape, _SIGNED_PARAMS)) + r")=)[^&\s'\"#<>]+"),
     r"\1" + REDACTED),
    # userinfo in a URL: scheme://user:password@host
    (re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/\s:@'\"]+:[^/\s@'\"]+@"), r"\1" + REDACTED + "@"),
)


def register(value: str) -> None:
    """Scrub ``value`` wherever it appears from now on."""
    if len(value) >= _MIN_REGISTERED:
        with _lock:
            _registered.add(value)


def scrub(text: str) -> str:
    """``text`` without any registered secret or token-shaped value (module docstring)."""
    if not text:
        return text
    with _lock:
        values = sorted(_registered, key=len, reverse=True)
    for value in values:
        if value in text:
            text = text.replace(value, REDACTED)
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


class Secret:
    """A token: redacted in every repr and str, its value only through ``reveal()``."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value
        register(value)

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"Secret('{REDACTED}')"

    __str__ = __repr__

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __reduce__(self) -> Any:  # a pickle or a deep copy keeps it a Secret
        return (Secret, (self._value,))


def reveal(token: Secret | str | None) -> str | None:
    """The value of a token given either way (a library's API takes a plain string)."""
    return token.reveal() if isinstance(token, Secret) else token


class ScrubFilter(logging.Filter):
    """Every record scrubbed before a handler formats it: its message with its arguments, and
    its traceback (formatted here, so the handler prints the scrubbed text)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not fit its format: keep both as text
            message = f"{record.msg} {record.args!r}"
        record.msg, record.args = scrub(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


_FILTER = ScrubFilter()


def install() -> None:
    """Scrub every handler of the root logger (call again after adding one) and what the
    interpreter prints for an uncaught exception, in the main thread or another."""
    for handler in logging.getLogger().handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
    if not getattr(sys.excepthook, "_scrubs", False):
        sys.excepthook = _scrubbing_excepthook
    if not getattr(threading.excepthook, "_scrubs", False):
        threading.excepthook = _scrubbing_thread_hook


def _print_scrubbed(exc_type: Any, exc: Any, tb: Any) -> None:
    import traceback

    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(scrub(text))
    sys.stderr.flush()


def _scrubbing_excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
    _print_scrubbed(exc_type, exc, tb)


def _scrubbing_thread_hook(args: Any) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    sys.stderr.write(f"Exception in thread {name}:\n")
    _print_scrubbed(args.exc_type, args.exc_value, args.exc_traceback)


_scrubbing_excepthook._scrubs = True  # type: ignore[attr-defined]
_scrubbing_thread_hook._scrubs = True  # type: ignore[attr-defined]
