"""What a new revision reuses of one installed before (``setup --stream ORG/NAME@NEWREV``).

Blobs are keyed by the expert's xxh3-128, and each counts only for the exact bytes it was verified
as (``manifest.provenance``: shard sha256, offsets, sizes). So an expert the new manifest gives
the installed revision's digest AND source key (its shard unchanged, same place) is the same blob:
cached already, it is never fetched again. One with the same digest elsewhere (its shard changed,
or it moved to another shard) is only the new manifest's word: the daemon reads and verifies its
new ranges when routing first needs it (no second copy if they match), and setup says what that
costs. Resident
tensors are compared the same way (name and xxh3-128); an unchanged one is copied from the old
install's resident file, verified against the new manifest, instead of downloaded
(``ResidentWriter``'s ``reuse``), and a config or tokenizer file with the sha256 the new
manifest pins is copied from the old install.

Invariants: nothing here trusts the old install: a copied tensor is hashed again and written only
if it matches the new manifest, else it is fetched. The counts are what the daemon holds now.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachecd.errors import CachecdError
from cachecd.manifest.manifest import Manifest
from cachecd.manifest.sha256 import file_sha256
from cachecd.report.coverage import unpack_detail
from cachecd.setup.resident import RESIDENT_FILE
from cachecd.sizes import format_size


@dataclass
class Delta:
    since: str  # the installed revision compared with
    experts: int  # the new revision's experts
    unchanged: int  # of them, with a digest the installed revision has
    cached: int  # of those at the same source (shard sha256, offsets), held by the daemon now
    moved: int  # of the unchanged, at another source: verified again against their new ranges
    moved_bytes: int
    changed_bytes: int  # the changed experts' bytes: what the new revision may still fetch
    tensors: int  # resident tensors installed
    tensors_unchanged: int
    tensors_changed_bytes: int
    old_resident: Path | None  # the installed revision's resident file, to copy from

    def lines(self) -> list[str]:
        changed = self.experts - self.unchanged
        uncached = self.unchanged - self.moved - self.cached
        also = f" ({uncached} more unchanged, not cached yet)" if uncached else ""
        moved = (f"{self.moved} unchanged but not in place (their shard changed or they moved): "
                 f"{format_size(self.moved_bytes)} to read again and verify as this revision's, "
                 f"when routing first needs them; ") if self.moved else ""
        return [f"{self.cached} of {self.experts} experts unchanged since {self.since[:12]} and "
                f"cached, reused{also}; {moved}{changed} changed "
                f"({format_size(self.changed_bytes)}), fetched when routing first needs them",
                f"{self.tensors_unchanged} of {self.tensors} resident tensors unchanged since "
                f"{self.since[:12]}, " + ("copied from its install; " if self.old_resident else
                                          "fetched (its install is not here); ")
                + f"{self.tensors - self.tensors_unchanged} changed "
                f"({format_size(self.tensors_changed_bytes)}), fetched"]


def installed_before(socket: Path, repo: str, commit: str) -> dict[str, Any] | None:
    """The registration of another revision of ``repo`` to compare with: the one with an
    install, the last registered if several (None when there is none, or no daemon runs)."""
    from cachecd_client import Client

    try:
        with Client(socket, timeout=60) as client:
            models = [m for m in client.models()
                      if m["repo"] == repo and m["revision"] != commit]
    except CachecdError:  # no daemon yet: nothing registered to compare with
        return None
    with_files = [m for m in models if m.get("local_dir")]
    return (with_files or models or [None])[-1]


def compare(socket: Path, old: dict[str, Any], new: Manifest, keep: set[str]) -> Delta | None:
    """The new manifest against ``old`` (a registration ``installed_before`` found); None if
    the daemon no longer answers for it."""
    from cachecd_client import Client

    name = f"{old['repo']}@{old['revision']}"
    try:
        with Client(socket, timeout=60) as client:
            before = Manifest.from_bytes(client.manifest_bytes(name), f"daemon:{name}")
            cached_bits, _ = unpack_detail(client.coverage(name, detail=True)["detail"])
    except CachecdError:
        return None
    old_digests = {d for d, _ in _pairs(before, None)}
    old_pairs, cached_pairs = _pairs(before, None), _pairs(before, cached_bits)
    rows = _pairs(new, None, ordered=True)
    unchanged = [d in old_digests for d, _ in rows]
    moved = [u and p not in old_pairs for u, p in zip(unchanged, rows, strict=True)]
    changed_bytes = int(new.sizes[[not u for u in unchanged]].sum()) if rows else 0
    old_tensors = {t.name: t.xxh3 for t in before.resident}
    mine = [t for t in new.resident if t.name in keep]
    same = [t for t in mine if old_tensors.get(t.name) == t.xxh3]
    local = Path(old["local_dir"]) / RESIDENT_FILE if old.get("local_dir") else None
    return Delta(
        since=old["revision"], experts=new.n_experts, unchanged=sum(unchanged),
        cached=sum(p in cached_pairs for p in rows), moved=sum(moved),
        moved_bytes=int(new.sizes[moved].sum()) if rows else 0, changed_bytes=changed_bytes,
        tensors=len(mine), tensors_unchanged=len(same),
        tensors_changed_bytes=sum(t.nbytes for t in mine) - sum(t.nbytes for t in same),
        old_resident=local if local is not None and local.is_file() else None)


def copy_if_same(source: Path, target: Path, sha256: str) -> bool:
    """Copy ``source`` (a file of another revision's install) to ``target`` if its bytes have
    ``sha256``, checked on the copy."""
    if not source.is_file() or file_sha256(source) != sha256:
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    if file_sha256(target) == sha256:
        return True
    target.unlink(missing_ok=True)
    return False



def _pairs(manifest: Manifest, mask: Any, *, ordered: bool = False) -> Any:
    """(digest, source key) of each expert (where ``mask``): a set, or a list in row order."""
    keys = manifest.source_keys()
    out = [(manifest.digests[i].tobytes(), keys[i]) for i in range(manifest.n_experts)
           if mask is None or mask[i]]
    return out if ordered else set(out)
