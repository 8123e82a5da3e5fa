"""Which manifest ``cachecd setup --stream`` installs by: ``--manifest`` FILE or hf://..., the one
cachecd ships, one an earlier setup stored, or one built now (``--build-manifest``). Whichever it
is, it must pin ``repo@commit`` and agree with the Hub's metadata and the shards' headers at that
commit (``check_on_use``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cachecd.config import Settings
from cachecd.errors import CachecdError, ManifestInvalid, Offline


def choose_manifest(args: argparse.Namespace, repo: str, commit: str,
                    settings: Settings, local: Path | None = None) -> tuple[Path, Any, str]:
    """The manifest file to use: --manifest FILE or hf://..., the shipped one, one made now from
    the shards' headers proven through Xet (``from_hub``; its small files into ``local``), or one
    built now; it must pin ``repo@commit`` and agree with the Hub's metadata and the shards'
    headers at that commit. With it, where it came from: ``built``, ``shipped``, ``headers`` or
    what --manifest named."""
    from cachecd.manifest import published
    from cachecd.manifest.manifest import Manifest, shipped_manifest

    path: Path | None
    origin = "shipped"
    if args.manifest and published.is_published(args.manifest):
        from huggingface_hub import get_token

        path, at = published.fetch(args.manifest, endpoint=settings.endpoint, token=get_token())
        origin = args.manifest
        print(f"manifest {args.manifest}" + (f" (its repo at {at})" if at else ""))
    elif args.manifest:
        path = Path(args.manifest)
        origin = str(path.resolve())
    else:
        path = shipped_manifest(repo)
        stale = path if path is not None and Manifest.load(path).revision != commit else None
        path = None if stale else path
        stored = stored_manifest(settings, repo, commit) if path is None else None
        if stored is not None and stored[1] == "built":  # a re-run reuses what it built here
            path, origin = stored
        if path is None and not args.build_manifest and local is not None and not settings.offline:
            # Where the shards are in Xet, nobody's word is needed: the map from proven headers.
            made = _from_headers(repo, commit, settings, local)
            if made is not None:
                return made
        if path is None:  # else what an earlier setup registered
            path, origin = stored or (None, "built")
        if path is None and not args.build_manifest:
            raise _no_manifest(repo, commit, stale)
    if path is None:
        path = settings.models_dir / "manifests" / manifest_name(repo, commit)
        _build_manifest(repo, commit, settings.endpoint, path)
        origin = "built"
    manifest = Manifest.load(path)
    if args.manifest:
        manifest.source = args.manifest  # messages name what the user gave (a hf:// URL)
    if manifest.repo != repo or manifest.revision != commit:
        raise ManifestInvalid(f"{manifest.source}: pins {manifest.repo}@{manifest.revision}, not "
                              f"{repo}@{commit}; pass --stream {manifest.repo}@{manifest.revision} "
                              f"to install the revision it pins, or a manifest of {commit}")
    check_on_use(manifest, settings)
    return path, manifest, origin


def check_on_use(manifest: Any, settings: Settings) -> None:
    """Refuse a manifest the Hub's metadata or the shards' own headers at its commit contradict
    (hub_check); offline, only against headers kept from an earlier check."""
    from huggingface_hub import get_token

    from cachecd.manifest.headers import keep_dir
    from cachecd.manifest.hub_check import check_against_hub, check_layout_at

    keep = keep_dir(settings.models_dir)
    if settings.offline:
        print("offline (HF_HUB_OFFLINE): the manifest is not checked against the Hub's metadata")
        try:
            check_layout_at(manifest, endpoint=settings.endpoint, keep=keep, offline=True)
            print("its experts' byte ranges checked against the shards' headers kept in " + str(keep))
        except Offline as exc:
            print(f"nor its layout: {exc.message}")
        return
    check_against_hub(manifest, endpoint=settings.endpoint, token=get_token(), keep=keep)
    print(f"manifest checked against {settings.endpoint}: {manifest.key}, its "
          f"{len(manifest.files)} files' sizes, the shards' sha256 and the config's hash, and "
          f"every expert's byte ranges against the shards' safetensors headers")


def _from_headers(repo: str, commit: str, settings: Settings,
                  local: Path) -> tuple[Path, Any, str] | None:
    """The manifest made from the shards' proven headers, saved beside the built ones (the
    daemon registers it from there); None where the repo's shards are not in Xet."""
    from cachecd.setup.from_hub import manifest_from_hub, on_xet_at
    from cachecd.setup.resident import make_private

    if not on_xet_at(repo, commit, settings.endpoint):
        return None
    make_private(settings.models_dir, repo)  # before the small files land
    local.mkdir(mode=0o700, parents=True, exist_ok=True)
    manifest = manifest_from_hub(repo, commit, settings, local)
    if manifest is None:
        return None
    path = settings.models_dir / "manifests" / (manifest_name(repo, commit) + ".headers")
    path.parent.mkdir(parents=True, exist_ok=True)
    manifest.save(path)
    return path, manifest, "headers"


def manifest_name(repo: str, commit: str) -> str:
    """The file name setup builds to and the daemon stores its copy under (``registry``)."""
    return f"{repo.replace('/', '--')}--{commit}.manifest"


def stored_manifest(settings: Settings, repo: str, commit: str) -> tuple[Path, str] | None:
    """The manifest of ``repo@commit`` an earlier setup left, with where it came from (what
    ``status`` tells): built into the models dir, or registered with the daemon (which keeps its
    own copy and its origin). It is checked like any other."""
    from cachecd_client import Client

    built = settings.models_dir / "manifests" / manifest_name(repo, commit)
    try:
        with Client(settings.socket, timeout=10) as client:
            info = client.model(f"{repo}@{commit}")
    except CachecdError:  # no daemon, or the repo is not registered with it
        info = {}
    # The daemon keeps its copy where setup builds: its record says whose word the copy is.
    registered = info.get("revision") == commit and Path(info.get("manifest") or "") == built
    if built.is_file() and not (registered and info.get("manifest_origin") != "built"):
        print(f"manifest {built} (stored by an earlier setup)")
        return built, "built"
    if not info:
        return None
    path = Path(info.get("manifest") or "")
    if info.get("revision") != commit or not path.is_file():
        return None
    print(f"manifest {path} (registered with the daemon by an earlier setup)")
    return path, str(info.get("manifest_origin") or path)


def _no_manifest(repo: str, commit: str, stale: Path | None) -> ManifestInvalid:
    if stale is not None:
        return ManifestInvalid(f"the shipped manifest {stale.name} pins another revision of "
                               f"{repo} than {commit}; pass --manifest FILE, @<its commit>, or "
                               "--build-manifest")
    return ManifestInvalid(f"no manifest ships for {repo} and no earlier setup stored one for "
                           f"{commit}; pass --manifest FILE or --build-manifest (reads the whole "
                           "revision once)")


def _build_manifest(repo: str, commit: str, endpoint: str, out: Path) -> None:
    from huggingface_hub import get_token

    from cachecd.manifest.build import build_to_file
    from cachecd.manifest.source import HubSource

    out.parent.mkdir(parents=True, exist_ok=True)
    # Finished shards stay in OUT.parts until the manifest is written: a rerun resumes there.
    build_to_file(HubSource(repo, commit, endpoint=endpoint, token=get_token()), out,
                  progress=sys.stderr.isatty(), say=lambda m: print(m, file=sys.stderr))
