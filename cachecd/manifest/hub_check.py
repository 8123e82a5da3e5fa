"""Check a manifest against the Hub's own metadata for the commit it pins, before it is used.

One metadata call per revision (``model_info`` with file metadata), remembered for the process
once it agrees. Compared:

- the commit: the Hub must know it as a commit of the repo;
- every file: present at that commit with the manifest's size; for an LFS file (every safetensors
  shard) the manifest's sha256 must be the Hub's LFS sha256; the Hub lists no file the manifest
  lacks;
- the config: ``config_sha256`` must be the sha256 of config.json at that commit (the Hub keeps a
  small config outside LFS and gives only its git blob id, so its bytes are fetched, checked
  against that blob id, and hashed).

Not compared: the sha256 of other small non-LFS files (the Hub has none to give; setup checks
them against the bytes it downloads) and the xxh3-128 of tensors and experts (the Hub has no hash
below a file): a wrong one fails the fetch of that expert and never lets a byte through.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Any

from cachecd import constants, errors
from cachecd.manifest.manifest import Manifest
from cachecd.manifest.source import hub_errors

log = logging.getLogger(__name__)

_agreed: set[tuple[str, str, str, str]] = set()  # (endpoint, repo, commit, fingerprint)
_lock = threading.Lock()


def fingerprint(manifest: Manifest) -> str:
    """What the check covers: the repo, commit, files and config hash."""
    files = [[f.name, f.size, f.sha256] for f in manifest.files.values()]
    what = [manifest.repo, manifest.revision, manifest.config_sha256, files]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def check_against_hub(manifest: Manifest, *, endpoint: str, token: str | None = None) -> None:
    """Raise ``ManifestMismatch`` naming what disagrees and what to do; ``UpstreamError`` (or
    ``Unauthorized``/``Gated``) when the endpoint could not be asked."""
    endpoint = endpoint.rstrip("/")
    key = (endpoint, manifest.repo, manifest.revision, fingerprint(manifest))
    with _lock:
        if key in _agreed:
            return
    found = problems(manifest, endpoint=endpoint, token=token)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise errors.ManifestMismatch(
            f"{manifest.source}: {found[0]}{more}. This manifest was not built from "
            f"{manifest.repo}@{manifest.revision} as {endpoint} serves it, or was altered: do not "
            f"use it; build one (cachecd manifest build {manifest.repo}@{manifest.revision}) or "
            "get it again from its publisher"
        )
    with _lock:
        _agreed.add(key)


def problems(manifest: Manifest, *, endpoint: str, token: str | None = None) -> list[str]:
    """Every disagreement with the Hub's metadata, as "FILE: FIELD ...", first the commit."""
    info = _model_info(manifest, endpoint, token)
    if info is None or info.sha != manifest.revision:
        why = f"it answered for {info.sha}" if info is not None else "or the repo is private"
        return [f"revision: {manifest.revision} is not a commit of {manifest.repo} on {endpoint} "
                f"({why})"]
    hub = {s.rfilename: s for s in info.siblings or ()}
    out = []
    for name, f in manifest.files.items():
        s = hub.pop(name, None)
        if s is None:
            out.append(f"{name}: in the manifest, not in {manifest.repo}@{manifest.revision}")
        elif s.size != f.size:
            out.append(f"{name}: size {f.size} in the manifest, {s.size} on the Hub")
        elif s.lfs is not None and s.lfs.sha256 != f.sha256:
            out.append(f"{name}: sha256 {f.sha256} in the manifest, {s.lfs.sha256} on the Hub")
    out += [f"{name}: on the Hub at that commit, missing from the manifest" for name in sorted(hub)]
    config = {s.rfilename: s for s in info.siblings or ()}.get("config.json")
    if not out and config is not None:
        sha = config.lfs.sha256 if config.lfs else _small_file_sha256(manifest, endpoint, token,
                                                                      config)
        if sha != manifest.config_sha256:
            out.append(f"config.json: config_sha256 {manifest.config_sha256} in the manifest, "
                       f"{sha} on the Hub")
        elif manifest.files["config.json"].sha256 != sha:
            out.append(f"config.json: sha256 {manifest.files['config.json'].sha256} in the "
                       f"manifest, {sha} on the Hub")
    return out


def _model_info(manifest: Manifest, endpoint: str, token: str | None) -> Any:
    """The Hub's metadata of the pinned commit; None when the Hub has no such repo or commit."""
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf_errors

    api = HfApi(endpoint=endpoint, token=token)
    try:
        return hub_errors(
            f"{manifest.repo}@{manifest.revision} on {endpoint}",
            lambda: api.model_info(manifest.repo, revision=manifest.revision, files_metadata=True,
                                   timeout=constants.CONNECT_TIMEOUT_S),
        )
    except errors.NotFound as exc:
        cause = exc.__cause__
        if isinstance(cause, hf_errors.RevisionNotFoundError | hf_errors.RepositoryNotFoundError):
            return None
        raise


def _small_file_sha256(manifest: Manifest, endpoint: str, token: str | None, s: Any) -> str:
    """sha256 of a non-LFS file's bytes at the commit, once they are the git blob the Hub lists."""
    from huggingface_hub import get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    url = hf_hub_url(manifest.repo, s.rfilename, revision=manifest.revision, endpoint=endpoint)

    def get() -> bytes:
        resp = get_session().get(url, headers=build_hf_headers(token=token),
                                 follow_redirects=True, timeout=constants.READ_TIMEOUT_S)
        hf_raise_for_status(resp)
        return bytes(resp.content)

    data = hub_errors(f"{manifest.repo}/{s.rfilename}", get)
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    if s.blob_id and blob != s.blob_id:
        raise errors.ChecksumMismatch(
            f"{s.rfilename} from {endpoint} is not the git blob {s.blob_id} the Hub lists at "
            f"{manifest.revision} (got {blob}); try again, or another endpoint"
        )
    return hashlib.sha256(data).hexdigest()
