"""Which model a plan is of, and where its figures come from: a manifest file, a manifest cachecd
ships, the running daemon's (a model installed with ``cachecd setup --stream``: its manifest,
and the config.json setup installed), or the Hub (a model not installed: ``hub_model``, its
config.json and its shards' headers, nothing else).

Invariant: the daemon is asked first for a repo name (what the user runs), then the manifests
cachecd ships (their config.json fetched from the Hub and checked against the sha256 the
manifest pins), then the Hub; a missing daemon or a repo it does not serve falls through. A
manifest file carries no config.json, so its plan says its compute is the routed experts'
alone.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachecd.errors import DaemonUnavailable, ModelNotFound
from cachecd.manifest.manifest import Manifest

log = logging.getLogger(__name__)


@dataclass
class Planned:
    manifest: Manifest
    config: dict[str, Any] | None  # the model's config.json; None: not known
    origin: str  # where the manifest came from, in words
    fetched: int | None = None  # bytes read from the Hub (a model not installed)
    shard_bytes: int | None = None  # its shards' size

    def describe(self) -> dict[str, Any]:
        return {"origin": self.origin, "config": self.config is not None,
                "fetched_bytes": self.fetched, "shard_bytes": self.shard_bytes}


def load(model: str, socket: str | None = None, endpoint: str | None = None,
         need_config: bool = True) -> Planned:
    """``need_config``: whether a shipped manifest's config.json is worth a request (the plan
    measures the compute or takes the top-k from it)."""
    from cachecd.manifest.manifest import shipped_manifest

    if Path(model).is_file():
        return Planned(Manifest.load(model), None, f"manifest file {model}")
    served = _served(model, socket)
    if served is not None:
        return served
    shipped = shipped_manifest(model)
    if shipped is not None:
        manifest = Manifest.load(shipped)
        config = _pinned_config(manifest, socket, endpoint) if need_config else None
        return Planned(manifest, config, "manifest shipped with cachecd")
    return _from_hub(model, socket, endpoint)


def _served(model: str, socket: str | None) -> Planned | None:
    """The daemon's manifest and installed config.json; None where no daemon answers or it does
    not serve ``model``."""
    from cachecd.config import load_settings
    from cachecd_client import Client

    try:
        with Client(load_settings({"socket": socket}).socket) as client:
            manifest = Manifest.from_bytes(client.manifest_bytes(model), f"daemon:{model}")
            local = client.model(model).get("local_dir")
    except (DaemonUnavailable, ModelNotFound, FileNotFoundError, ConnectionError):
        return None
    config = None
    if local and (path := Path(local) / "config.json").is_file():
        config = json.loads(path.read_text())
    return Planned(manifest, config, "the running daemon's (installed)")


def _endpoint(socket: str | None, endpoint: str | None) -> str:
    from cachecd.config import load_settings

    return endpoint or load_settings({"socket": socket}).endpoint


def _pinned_config(manifest: Manifest, socket: str | None,
                   endpoint: str | None) -> dict[str, Any] | None:
    """A shipped manifest's config.json from the Hub (the bytes it pins), or None where the Hub
    cannot give it (offline): the plan then says its compute is the routed experts' alone."""
    from huggingface_hub import get_token

    from cachecd import constants
    from cachecd.plan.hub_model import config_of

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        return config_of(manifest.repo, manifest.revision, manifest.config_sha256,
                         endpoint=_endpoint(socket, endpoint), token=get_token())
    except Exception as exc:  # noqa: BLE001 - optional: any failure leaves the routed probe
        log.warning("config_unavailable repo=%s error=%s", manifest.repo, exc)
        return None


def _from_hub(model: str, socket: str | None, endpoint: str | None) -> Planned:
    from huggingface_hub import get_token

    from cachecd.manifest.repo_ref import parse_ref
    from cachecd.plan.hub_model import from_hub

    repo, rev = parse_ref(model)
    url = _endpoint(socket, endpoint)
    got = from_hub(repo, rev, endpoint=url, token=get_token())
    return Planned(got.manifest, got.config, f"not installed: {url}'s config.json and shard "
                   "headers", got.fetched, got.shard_bytes)
