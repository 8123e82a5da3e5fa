"""How a request's ``ORG/NAME@REV`` names a registration, and what a miss says.

Invariants:
- ``REV`` names a registration by its commit, 7+ of the commit's first hex digits, or a revision
  name (branch or tag) setup was given for it (``setup --stream ORG/NAME@v2`` registers its
  commit with the name ``v2``). A name belongs to one registration of a repo at a time: a name
  registered again with another commit moves there (``main`` moves on).
- Nothing is resolved against the Hub here: the names are those setup recorded, so a request
  works offline and never picks a revision the user did not install.
- A miss names what is registered and the closest name (``difflib``); it does not tell the user
  to run the setup they may just have run.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from typing import Any, Protocol

from cachecd.errors import InvalidRequest
from cachecd.manifest.repo_ref import REVISION

_NAME_RE = re.compile(REVISION)
MAX_NAMES = 16  # names a registration keeps (branches and tags it was installed as)


class Named(Protocol):
    @property
    def repo(self) -> str: ...
    @property
    def commit(self) -> str: ...
    names: tuple[str, ...]


def check_names(names: Any) -> tuple[str, ...]:
    """The revision names a register call gives, checked (a list of REV strings, or none)."""
    if names is None:
        return ()
    if (not isinstance(names, (list, tuple)) or len(names) > MAX_NAMES
            or not all(isinstance(n, str) and _NAME_RE.fullmatch(n) for n in names)):
        raise InvalidRequest(f"names must be a list of up to {MAX_NAMES} revision names "
                             f"(letters, digits, . _ -), got {names!r}")
    return tuple(dict.fromkeys(names))


def names_rev(commit: str, rev: str) -> bool:
    """``rev`` names ``commit`` by itself: the commit, or 7+ of its first hex digits."""
    return commit == rev or (len(rev) >= 7 and commit.startswith(rev))


def matches(m: Named, repo: str, rev: str) -> bool:
    return m.repo == repo and (not rev or names_rev(m.commit, rev) or rev in m.names)


def label(m: Named) -> str:
    """``ORG/NAME@COMMIT12 (v2, main)``: the registration and the names it answers to."""
    names = f" ({', '.join(m.names)})" if m.names else ""
    return f"{m.repo}@{m.commit[:12]}{names}"


def closest(spec: str, models: list[Any]) -> str | None:
    """The registered name most like ``spec`` (a typo of the repo or of the revision), if any;
    a bare ``ORG/NAME`` only where it names one registration."""
    repos = Counter(m.repo for m in models)
    spellings = []
    for m in models:
        spellings += [f"{m.repo}@{n}" for n in m.names] + [f"{m.repo}@{m.commit[:12]}"]
        spellings += [m.repo] if repos[m.repo] == 1 else []
    found = difflib.get_close_matches(spec, spellings, n=1, cutoff=0.6)
    return found[0] if found else None


def miss_message(spec: str, repo: str, rev: str, models: list[Any], hint: str = "") -> str:
    """What a request for ``spec`` that names no registration is told: what is registered and
    the closest name. The setup to run only for a repo nothing registered is like: a revision
    of a registered repo, or a near miss, is more likely a name mistyped (or the setup just run)
    than a model not installed."""
    install = f"; install it with `cachecd setup --stream {spec}`"
    if not models:
        return f"no manifest is registered for {spec}{hint}{install}"
    near = closest(spec, models)
    if any(m.repo == repo for m in models):
        what, then = f"{repo} is not registered at {rev}", ""
    else:
        what, then = f"no manifest is registered for {spec}{hint}", "" if near else install
    mean = f"; did you mean {near}?" if near else ""
    return f"{what}; registered: {', '.join(label(m) for m in models)}{mean}{then}"
