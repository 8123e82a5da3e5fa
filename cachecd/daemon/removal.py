"""Removing a registered model (``cachecd remove``): unregister it, then free what only it used.

Invariants:
- The registration goes first, from memory and durably from the index, so a restart never brings
  back a model whose files are going; from then on a request for it is refused (repo_not_allowed).
- Only what setup installed for this daemon is deleted: the registration's resident dir, if it
  lies under the daemon's models dir, and never a pipeline rank's install inside it
  (``pipeline-R-of-N``: another daemon's registration). A folder registered from elsewhere is
  the caller's and stays. The manifest copy stays too: it is small, and a built one cost a read
  of the whole revision; ``setup --stream --manifest`` registers it again.
- Blobs are content-addressed (the xxh3-128 of the expert's bytes), so two models can share one:
  a blob that another registered model's manifest names is neither unpinned nor evicted. The
  removed model's own blobs are unpinned (a pin of a model no longer registered could never be
  lifted) and, with ``experts``, evicted now; otherwise the eviction policy takes them when it
  needs room. A blob a request holds at that moment is left to the policy as well.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cachecd.daemon.app import Daemon
    from cachecd.daemon.registry import RegisteredModel
    from cachecd.manifest.manifest import Manifest

log = logging.getLogger(__name__)

_RANK_DIR = re.compile(r"pipeline-\d+-of-\d+")


async def remove_model(daemon: Daemon, repo: str, experts: bool) -> dict[str, Any]:
    """Unregister ``repo`` and free its resident files and (with ``experts``) its cached
    experts; what was freed and what was kept, and why."""
    model, record = await daemon.registry.unregister(repo)
    manifest = model.manifest if model else await asyncio.to_thread(_load, record)
    name = record.get("repo") or (model.repo if model else repo)  # ORG/NAME, without @REV
    out: dict[str, Any] = {
        "repo": name,
        "revision": manifest.revision if manifest else record.get("revision"),
        "manifest": record.get("manifest"),
        "registered_at_start": name in daemon.registry.at_start,
    }
    others = daemon.registry.all()
    out.update(await asyncio.to_thread(remove_resident, daemon.settings.models_dir,
                                       record.get("local_dir"), others))
    out.update(await _release_experts(daemon, manifest, others, experts))
    log.info("model removed repo=%s resident_bytes_freed=%d expert_bytes_freed=%d", repo,
             out["resident_bytes_freed"], out["expert_bytes_freed"])
    return out


def _load(record: dict[str, Any]) -> Manifest | None:
    from cachecd.errors import CachecdError
    from cachecd.manifest.manifest import Manifest

    try:
        return Manifest.load(Path(record["manifest"]))
    except (CachecdError, OSError, KeyError):
        return None


def remove_resident(models_dir: Path, local_dir: str | None,
                    others: list[RegisteredModel]) -> dict[str, Any]:
    """Delete the registration's install dir if setup made it for this daemon (and nothing
    else registered uses it), then the parents it leaves empty, up to ``models_dir``."""
    out: dict[str, Any] = {"resident_dir": local_dir, "resident_bytes_freed": 0,
                           "resident_kept": None}
    if not local_dir:
        return out
    path = Path(local_dir).resolve()
    root = models_dir.resolve()
    if not path.is_relative_to(root) or path == root:
        out["resident_kept"] = (f"it is not under the daemon's models dir {root}, so setup did "
                                "not install it")
    elif any(_overlap(path, m.local_dir.resolve()) for m in others if m.local_dir):
        out["resident_kept"] = "another registered model uses it"
    elif path.is_dir():
        out["resident_bytes_freed"] = _delete_install(path)
        for parent in [path, *path.parents]:
            if parent == root or not parent.is_relative_to(root):
                break
            try:
                parent.rmdir()  # only when empty: another revision or rank stays
            except OSError:
                break
    return out


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def _delete_install(path: Path) -> int:
    """Everything in ``path`` but pipeline ranks' installs; the bytes it held."""
    freed = 0
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            if _RANK_DIR.fullmatch(child.name):
                continue  # a rank of this revision, registered with another daemon
            freed += _tree_bytes(child)
            shutil.rmtree(child)
        else:
            freed += child.lstat().st_size
            child.unlink()
    return freed


def _tree_bytes(path: Path) -> int:
    total = 0
    for base, _dirs, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(base, name)).st_size
    return total


def digest_set(manifest: Manifest) -> set[str]:
    """Every expert blob the manifest names (hex digests, as the store keys them)."""
    hexes = manifest.digests.tobytes().hex()
    return {hexes[i * 32:(i + 1) * 32] for i in range(manifest.n_experts)}


async def _release_experts(daemon: Daemon, manifest: Manifest | None,
                           others: list[RegisteredModel], evict: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"experts_cached": 0, "expert_bytes_cached": 0, "experts_evicted": 0,
                           "expert_bytes_freed": 0, "experts_shared": 0, "experts_unpinned": 0,
                           "experts_in_use": 0, "experts_unknown": manifest is None}
    if manifest is None:  # its manifest is gone or unreadable: which blobs were its is unknown
        return out
    mine, shared = await asyncio.to_thread(_split, manifest, others)
    store = daemon.store
    await daemon.misses.settled()  # what was answered is committed before it is looked at
    own = [d for d in mine - shared if store.has(d)]
    pinned = store.pins() & set(own)
    for d in pinned:
        await store.unpin(d)
    out.update(experts_cached=len(own), experts_unpinned=len(pinned),
               expert_bytes_cached=sum(store.size_of(d) or 0 for d in own),
               experts_shared=sum(1 for d in mine & shared if store.has(d)))
    if evict and own:
        out["expert_bytes_freed"] = await store.evict(own)
        left = sum(1 for d in own if store.has(d))
        out.update(experts_evicted=len(own) - left, experts_in_use=left)
    return out


def _split(manifest: Manifest, others: list[RegisteredModel]) -> tuple[set[str], set[str]]:
    """The removed model's blobs, and those of them another registered model names too."""
    mine = digest_set(manifest)
    shared: set[str] = set()
    for m in others:
        shared |= mine & digest_set(m.manifest)
    return mine, shared
