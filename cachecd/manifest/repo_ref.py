"""Repo names and revisions: the one parser every command line, the daemon's routes, the
manifest and the local hub use, so a name one accepts is a name every other accepts.

A repo is ``ORG/NAME``: each part starts with a letter or digit, then up to 95 more of letters,
digits, ``.``, ``_``, ``-``, and never holds ``..`` (a part is also a folder name). A revision
(``REPO@REV``) is a branch, tag or commit of letters, digits, ``.``, ``_``, ``-``; a pinned one is
a 40-hex commit.
"""

from __future__ import annotations

import re

from cachecd import errors

PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
REPO = rf"{PART}/{PART}"
REVISION = r"[\w.-]+"
_PART_RE = re.compile(PART)
_REF_RE = re.compile(rf"(?P<repo>{REPO})(?:@(?P<rev>{REVISION}))?")
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")


def valid_part(part: str) -> bool:
    """An org or repo name (one folder name, never ``.`` or ``..``)."""
    return bool(_PART_RE.fullmatch(part)) and ".." not in part


def valid_repo(repo: str) -> bool:
    org, sep, name = repo.partition("/")
    return bool(sep) and valid_part(org) and valid_part(name)


def check_repo(repo: str) -> str:
    """``repo`` if it is ``ORG/NAME`` by the rule above; InvalidRequest otherwise (before any I/O)."""
    org, sep, name = repo.partition("/")
    if not sep:
        raise errors.InvalidRequest(f"model {repo!r} must be ORG/NAME")
    for part in (org, name):
        if not valid_part(part):
            raise errors.InvalidRequest(
                f"{part!r} is not a valid repo name part (letters, digits, . _ -)")
    return repo


def parse_ref(spec: str, default_revision: str = "main") -> tuple[str, str]:
    """``ORG/NAME[@REV]`` -> (repo, revision); the revision defaults to ``default_revision``."""
    m = _REF_RE.fullmatch(spec)
    if m is None or ".." in spec:
        raise errors.InvalidRequest(f"{spec!r} is not ORG/NAME[@REV]")
    return m.group("repo"), m.group("rev") or default_revision


def is_commit(revision: str) -> bool:
    """A pinned revision: a full 40-hex commit."""
    return bool(_COMMIT_RE.fullmatch(revision))
