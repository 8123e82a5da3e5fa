"""Manifests published in a Hub repo: ``hf://[datasets/]ORG/REPO/PATH[@REV]``.

One build serves everyone: whoever built a manifest uploads it (``hf upload``) to a model or a
dataset repo, and others name it by this URL. It is fetched with huggingface_hub's
``hf_hub_download`` (its cache, token, endpoint and offline mode), from the same endpoint as the
model. ``ORG/REPO@REV/PATH`` (huggingface_hub's HfFileSystem form) is accepted too. A published
manifest is trusted no more than any other: it is checked against the model's own metadata on
use (``hub_check``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from cachecd import errors
from cachecd.manifest.repo_ref import REPO, REVISION
from cachecd.manifest.source import hub_errors

PREFIX = "hf://"
_URL = re.compile(
    r"hf://(?:(?P<kind>datasets|models)/)?"
    rf"(?P<repo>{REPO})(?:@(?P<rev>{REVISION}))?"
    rf"/(?P<path>[^@]+?)(?:@(?P<rev2>{REVISION}))?"
)


@dataclass(frozen=True)
class Published:
    repo_type: str  # "model" or "dataset"
    repo_id: str
    path: str
    revision: str | None  # None: the repo's default branch

    def __str__(self) -> str:
        kind = "datasets/" if self.repo_type == "dataset" else ""
        rev = f"@{self.revision}" if self.revision else ""
        return f"{PREFIX}{kind}{self.repo_id}/{self.path}{rev}"


def is_published(text: str) -> bool:
    return text.startswith(PREFIX)


def parse(text: str) -> Published:
    m = _URL.fullmatch(text)
    if m is None or (m["rev"] and m["rev2"]):
        raise errors.InvalidRequest(
            f"{text!r}: expected hf://ORG/REPO/PATH[@REV] or hf://datasets/ORG/REPO/PATH[@REV]"
        )
    path = m["path"]
    if any(part in ("", ".", "..") for part in path.split("/")) or "\\" in path:
        raise errors.InvalidRequest(f"{text!r}: {path!r} is not a path inside the repo")
    kind = "dataset" if m["kind"] == "datasets" else "model"
    return Published(kind, m["repo"], path, m["rev"] or m["rev2"])


def fetch(text: str, *, endpoint: str, token: str | None = None) -> tuple[Path, str]:
    """The local path of the published manifest (huggingface_hub's cache) and the commit of
    its repo it came from ("" when the cache layout does not say)."""
    from huggingface_hub import hf_hub_download

    p = parse(text)
    local = Path(hub_errors(str(p), lambda: hf_hub_download(
        p.repo_id, p.path, repo_type=p.repo_type, revision=p.revision, endpoint=endpoint,
        token=token)))
    # The cache keeps it as .../snapshots/<commit>/<path>.
    snapshot = local.parents[len(p.path.split("/")) - 1]
    commit = snapshot.name if re.fullmatch(r"[0-9a-f]{40}", snapshot.name) else ""
    return local, commit
