"""Whether setup's model can be streamed, and whether its disk holds what a step writes: asked
before the step, so a model the engine cannot run is refused before a manifest build (one pass
over the whole revision) or a resident install, and a full disk before the bytes start.

- The model type is its config.json's at the pinned commit (one small download into a temp
  dir, nothing installed), against ``constants.SUPPORTED_MODEL_TYPES``, the engine's list.
  Offline, a config.json an earlier install of the commit left is read; with none, the check
  waits for the one setup installs (before the resident weights).
- Free disk: what a step will write that is not there yet, against the free bytes of the
  filesystem it writes to.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from cachecd import constants
from cachecd.errors import DiskFull, UnsupportedFormat
from cachecd.sizes import format_size


def check_model_type(config: dict[str, Any], name: str) -> None:
    """Refuse a config whose ``model_type`` the engine cannot stream, listing those it can."""
    kind = config.get("model_type")
    if kind in constants.SUPPORTED_MODEL_TYPES:
        return
    raise UnsupportedFormat(
        f"{name}: its config.json says model_type {kind!r}, which cachecd cannot stream "
        f"(supported: {', '.join(constants.SUPPORTED_MODEL_TYPES)}); nothing was installed")


def hub_config(repo: str, commit: str, endpoint: str, offline: bool,
               installed: Path) -> dict[str, Any] | None:
    """The repo's config.json at ``commit``: from the Hub, or offline from ``installed`` (an
    earlier install of the commit); None offline with none there."""
    if offline:
        path = installed / "config.json"
        return json.loads(path.read_text()) if path.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError

    from cachecd.manifest.bounds import loads

    with tempfile.TemporaryDirectory(prefix="cachecd-config-") as tmp:
        try:
            got = hf_hub_download(repo, "config.json", revision=commit, endpoint=endpoint,
                                  local_dir=tmp)
        except (EntryNotFoundError, RevisionNotFoundError):
            return None  # the manifest's check says what is wrong with this commit, in its words
        config = loads(Path(got).read_bytes(), f"{repo}@{commit[:12]}/config.json", "config")
        return dict(config) if isinstance(config, dict) else None


def check_room(where: Path, need: int, what: str, instead: str) -> None:
    """Refuse ``need`` more bytes under ``where`` (its nearest existing parent) when its
    filesystem has less free."""
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise DiskFull(f"{what} needs {format_size(need)} more on {probe} and its disk has "
                       f"{format_size(free)} free; free some room there, or {instead}")


def resident_need(manifest: Any, local: Path, keep: set[str] | None) -> int:
    """Bytes the resident install will still write under ``local``: the kept tensors and the
    small files, less what is there already (a resumed install)."""
    tensors = sum(t.nbytes for t in manifest.resident if keep is None or t.name in keep)
    small = sum(f.size for f in manifest.files.values() if not f.name.endswith(".safetensors"))
    there = sum(f.stat().st_size for f in local.rglob("*") if f.is_file()) if local.is_dir() else 0
    return max(0, tensors + small - there)
