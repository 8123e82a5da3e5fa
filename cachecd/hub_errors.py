"""The Hub's and the network's exceptions as cachecd's typed errors: the one place they are mapped.

huggingface_hub raises its own types (``RepositoryNotFoundError``, ``GatedRepoError``, ...) and
lets its HTTP client's transport errors through (connection refused, timeouts). Every command gets
them as one of cachecd's errors (``errors``): a message that names the repo, revision or file
(from the request's URL when the caller did not say) and what to do next, never a token.
:func:`translate` gives ``None`` for anything else, which stays a bug with its traceback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from cachecd import errors

_LOGIN = "log in with `hf auth login` or set HF_TOKEN"
_OFFLINE_HINT = ("to work without the network, set HF_HUB_OFFLINE=1 and name a revision installed "
                 "before (ORG/NAME@COMMIT)")
# /api/models/ORG/NAME[/revision/REV | /tree/REV/...] and [datasets/]ORG/NAME/resolve/REV/PATH
_API = re.compile(r"^/api/(?:models|datasets|spaces)/([^/]+/[^/]+)(?:/(?:revision|tree)/([^/]+))?")
_URL_IN_TEXT = re.compile(r"https?://[^\s'\"]+")
_RESOLVE = re.compile(r"^/(?:datasets/|spaces/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


@dataclass(frozen=True)
class Target:
    """What a failed request asked for, read from its URL."""

    origin: str = ""  # scheme://host[:port]
    repo: str = ""
    revision: str = ""
    file: str = ""

    def name(self) -> str:
        at = f"@{self.revision}" if self.revision and self.revision != "main" else ""
        path = f"/{self.file}" if self.file else ""
        return f"{self.repo}{at}{path}" if self.repo else self.origin or "the Hub"


def target_of(url: str) -> Target:
    parts = urlsplit(url)
    origin = f"{parts.scheme}://{parts.netloc}" if parts.netloc else ""
    path = unquote(parts.path)
    if m := _RESOLVE.match(path):
        return Target(origin, m[1], m[2], m[3])
    if m := _API.match(path):
        return Target(origin, m[1], m[2] or "")
    return Target(origin)


def _request_url(exc: BaseException) -> str:
    """The URL the failed request went to; else the first one its message names (offline mode
    says which URL it would not fetch)."""
    response = getattr(exc, "response", None)  # huggingface_hub's HTTP errors
    try:
        # httpx's `.request` raises RuntimeError when the error was made without one.
        request = response.request if response is not None else getattr(exc, "request", None)
    except RuntimeError:
        request = None
    url = str(getattr(request, "url", "") or "")
    if not url and (m := _URL_IN_TEXT.search(str(exc))):
        url = m[0].rstrip(".,:;'\"")
    return url


def translate(exc: BaseException, what: str | None = None) -> errors.CachecdError | None:
    """cachecd's error for a Hub or network exception (``what`` names the object if the caller
    knows better than the URL); ``None`` when ``exc`` is neither."""
    if isinstance(exc, errors.CachecdError):
        return exc
    for link in _chain(exc):
        typed = _one(link, what)
        if typed is not None:
            return typed
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """The exceptions to try, in order. huggingface_hub wraps the reason it could not fetch (a
    connection refused, offline mode) in ``LocalEntryNotFoundError``, whose own message does not
    say which: its causes come first, innermost first, then it. Anything else: itself only."""
    out: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in out and len(out) < 8:
        out.append(link)
        link = link.__cause__ or link.__context__
    return [*reversed(out[1:]), out[0]] if _is_local_entry(out[0]) else out[:1]


def _is_local_entry(exc: BaseException) -> bool:
    from huggingface_hub import errors as hf

    return isinstance(exc, hf.LocalEntryNotFoundError)


def _one(exc: BaseException, what: str | None) -> errors.CachecdError | None:
    from huggingface_hub import errors as hf

    t = target_of(_request_url(exc))
    if not t.repo and getattr(exc, "repo_id", None):
        t = Target(t.origin, str(exc.repo_id))  # type: ignore[attr-defined]
    name = what or t.name()
    if isinstance(exc, hf.OfflineModeIsEnabled):
        return errors.Offline(f"{name}: HF_HUB_OFFLINE is set and it is not in the local cache; "
                              "unset HF_HUB_OFFLINE to fetch it, or name a revision installed "
                              "before (ORG/NAME@COMMIT)")
    if isinstance(exc, hf.LocalEntryNotFoundError):
        return errors.Offline(f"{name}: not in the local cache, and the Hub could not be asked "
                              "for it; check the network, or unset HF_HUB_OFFLINE")
    if isinstance(exc, hf.HfHubHTTPError):
        return _http(exc, t, name)
    return _transport(exc, t, name)


def _http(exc: Any, t: Target, name: str) -> errors.CachecdError:
    from huggingface_hub import errors as hf

    status = exc.response.status_code if exc.response is not None else None
    where = t.origin or "the Hub"
    if isinstance(exc, hf.GatedRepoError):
        page = f"{t.origin or 'https://huggingface.co'}/{t.repo or name}"
        return errors.Gated(f"{name}: a gated repo: request access at {page}, then {_LOGIN} "
                            "with the account that has it")
    if isinstance(exc, hf.RepositoryNotFoundError):
        return errors.NotFound(f"{name}: no such repo on {where}: check the name; if it is "
                               f"private, {_LOGIN}")
    if isinstance(exc, hf.RevisionNotFoundError):
        return errors.NotFound(f"{name}: no such revision on {where}: name a branch, tag or "
                               "commit the repo has (ORG/NAME@REV)")
    if isinstance(exc, hf.EntryNotFoundError):
        return errors.NotFound(f"{name}: no such file at that revision on {where}: the manifest "
                               "or the revision is not this repo's")
    if status in (401, 403):
        lines = str(getattr(exc, "server_message", None) or "").strip().splitlines()
        said = f": {lines[0][:200]}" if lines else ""
        return errors.Unauthorized(f"{name}: {where} refused the request (HTTP {status}{said}); "
                                   f"{_LOGIN} with a token that can read it")
    if status == 429:
        return errors.UpstreamRateLimited(f"{name}: {where} rate-limits this token or address "
                                          "(HTTP 429); retry later, or log in for a higher limit")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return errors.UpstreamError(f"{name}: HTTP {status} from {where}: {first}; retry later")


def _transport(exc: BaseException, t: Target, name: str) -> errors.CachecdError | None:
    """A connection that failed: the HTTP client's own types (httpx, or the httpx2 this
    huggingface_hub uses), matched by their names so either client is recognised."""
    kinds = {c.__name__ for c in type(exc).__mro__
             if c.__module__.split(".")[0].startswith(("httpx", "httpcore"))}
    where = t.origin or "the Hub"
    if "TimeoutException" in kinds:
        return errors.UpstreamTimeout(f"{name}: {where} did not answer in time ({exc}); check "
                                      f"the network and retry; {_OFFLINE_HINT}")
    if "TransportError" in kinds:
        verb = "cannot reach" if "ConnectError" in kinds else "lost the connection to"
        return errors.UpstreamError(f"{name}: {verb} {where} ({exc}); check the network and "
                                    f"--endpoint / HF_ENDPOINT; {_OFFLINE_HINT}")
    return None
