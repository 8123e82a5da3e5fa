"""Check a manifest against the Hub for the commit it pins, before it is used.

Two checks, each remembered for the process once it passes (keyed by endpoint and by everything
the manifest says, so another manifest of the same commit is checked afresh):

The metadata: one call per revision (``model_info`` with file metadata). Compared:

- the commit: the Hub must know it as a commit of the repo;
- every file: present at that commit with the manifest's size; for an LFS file (every safetensors
  shard) the manifest's sha256 must be the Hub's LFS sha256; the Hub lists no file the manifest
  lacks;
- the config: ``config_sha256`` must be the sha256 of config.json at that commit (the Hub keeps a
  small config outside LFS and gives only its git blob id, so its bytes are fetched, checked
  against that blob id, and hashed).

The layout (``layout_check``): every expert's and resident tensor's name, shard, offset, size,
dtype and shape against the safetensors headers of the shards at that commit (``headers``:
fetched by range, kept). After both, a manifest can be wrong only in its xxh3-128 hashes (the Hub
has no hash below a file), and a wrong one fails the fetch of that expert: it never lets a byte
through. Not compared: the sha256 of other small non-LFS files (setup checks them against the
bytes it downloads).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

from cachecd import constants, errors
from cachecd.manifest import bounded_http
from cachecd.manifest.headers import PARALLEL, confirm_fresh, keep_fresh, shard_headers
from cachecd.manifest.layout_check import layout_problems, mismatch
from cachecd.manifest.manifest import Manifest
from cachecd.manifest.source import hub_errors

log = logging.getLogger(__name__)

_agreed: set[tuple[str, str, str]] = set()  # (what, endpoint or "kept", content sha256)
_lock = threading.Lock()


def _memo(what: str, endpoint: str, manifest: Manifest) -> tuple[str, str, str]:
    return (what, endpoint, manifest.content_sha256())


def _remembered(key: tuple[str, str, str]) -> bool:
    with _lock:
        return key in _agreed


def _remember(key: tuple[str, str, str]) -> None:
    with _lock:
        _agreed.add(key)


def check_against_hub(manifest: Manifest, *, endpoint: str, token: str | None = None,
                      keep: Path | None = None) -> None:
    """Both checks: raise ``ManifestMismatch`` naming what disagrees and what to do;
    ``UpstreamError`` (or ``Unauthorized``/``Gated``) when the endpoint could not be asked."""
    check_metadata(manifest, endpoint=endpoint, token=token)
    check_layout_at(manifest, endpoint=endpoint, token=token, keep=keep)


def check_metadata(manifest: Manifest, *, endpoint: str, token: str | None = None) -> None:
    """The metadata check alone (see the module docstring)."""
    endpoint = endpoint.rstrip("/")
    key = _memo("metadata", endpoint, manifest)
    if _remembered(key):
        return
    found = metadata_problems(manifest, endpoint=endpoint, token=token)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise errors.ManifestMismatch(
            f"{manifest.source}: {found[0]}{more}. This manifest was not built from "
            f"{manifest.repo}@{manifest.revision} as {endpoint} serves it, or was altered: do not "
            f"use it; build one (cachecd manifest build {manifest.repo}@{manifest.revision}) or "
            "get it again from its publisher"
        )
    _remember(key)


def check_layout_at(manifest: Manifest, *, endpoint: str, token: str | None = None,
                    keep: Path | None = None, offline: bool = False, retry: bool = True,
                    parallel: int = PARALLEL, deadline_s: float | None = None) -> None:
    """The layout check alone, against headers kept in ``keep`` or fetched from ``endpoint``,
    ``parallel`` at a time, within ``deadline_s`` (``Offline`` when they are not kept and
    ``offline``)."""
    endpoint = endpoint.rstrip("/")
    key = _memo("layout", "", manifest)  # headers are addressed by content: any endpoint's do
    if _remembered(key):
        return
    found = _layout(manifest, endpoint, token, keep, offline, retry, parallel, deadline_s)
    if found:
        raise mismatch(manifest, found)
    _remember(key)


def _layout(manifest: Manifest, endpoint: str, token: str | None, keep: Path | None,
            offline: bool, retry: bool, parallel: int,
            deadline_s: float | None = None) -> list[str]:
    """The layout's problems; fresh headers that find some are read again first, and are kept
    only once they find none."""
    heads = shard_headers(manifest, endpoint=endpoint, token=token, keep=keep, offline=offline,
                          retry=retry, parallel=parallel, deadline_s=deadline_s)
    found = layout_problems(manifest, heads.of)
    if found and heads.fresh:
        confirm_fresh(manifest, heads, endpoint=endpoint, token=token, parallel=parallel,
                      deadline_s=deadline_s)
    if not found:
        keep_fresh(keep, manifest, heads, endpoint)
    return found


def problems(manifest: Manifest, *, endpoint: str, token: str | None = None,
             keep: Path | None = None) -> list[str]:
    """Every disagreement, as "FILE: FIELD ..." or "layer L expert E: ...": the metadata's,
    then (when it agrees) the layout's."""
    found = metadata_problems(manifest, endpoint=endpoint, token=token)
    if found:
        return found
    return _layout(manifest, endpoint.rstrip("/"), token, keep, False, True, PARALLEL)


def metadata_problems(manifest: Manifest, *, endpoint: str,
                      token: str | None = None) -> list[str]:
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
    from huggingface_hub import errors as hf_errors

    try:
        return model_info(manifest.repo, manifest.revision, endpoint=endpoint, token=token)
    except errors.NotFound as exc:
        cause = exc.__cause__
        if isinstance(cause, hf_errors.RevisionNotFoundError | hf_errors.RepositoryNotFoundError):
            return None
        raise


def model_info(repo: str, revision: str, *, endpoint: str, token: str | None = None,
               files: bool = True) -> Any:
    """huggingface_hub's ``ModelInfo`` of ``repo@revision`` (with each file's metadata when
    ``files``), its answer read within ``bounded_http``'s bounds: a bad one is
    ``UpstreamAnswerInvalid`` naming the repo; the Hub's errors as ``hub_errors`` types them."""
    from urllib.parse import quote

    from huggingface_hub import get_session
    from huggingface_hub.hf_api import ModelInfo
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    endpoint = endpoint.rstrip("/")
    what = f"{repo}@{revision} on {endpoint}"
    url = (f"{endpoint}/api/models/{repo}/revision/{quote(revision, safe='')}"
           f"{'?blobs=true' if files else ''}")

    def get() -> Any:
        answer = bounded_http.get(get_session(), url, build_hf_headers(token=token),
                                  cap=bounded_http.METADATA_BYTES, what=f"metadata of {what}",
                                  endpoint=endpoint, timeout=constants.CONNECT_TIMEOUT_S)
        hf_raise_for_status(bounded_http.as_response(answer))
        data = bounded_http.json_answer(answer, f"metadata of {what}")
        try:
            return ModelInfo(**data)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise errors.UpstreamAnswerInvalid(
                f"metadata of {what}: its answer is not a model's metadata ({type(exc).__name__}); "
                "try again later, or another endpoint (--endpoint / HF_ENDPOINT)") from None

    return hub_errors(what, get)


def _small_file_sha256(manifest: Manifest, endpoint: str, token: str | None, s: Any) -> str:
    """sha256 of a non-LFS file's bytes at the commit, once they are the git blob the Hub lists."""
    from huggingface_hub import get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    url = hf_hub_url(manifest.repo, s.rfilename, revision=manifest.revision, endpoint=endpoint)
    what = f"{manifest.repo}/{s.rfilename}"

    def get() -> bytes:
        hf = build_hf_headers(token=token)
        plain = {k: v for k, v in hf.items() if k.lower() != "authorization"}
        answer = bounded_http.get(get_session(), url, hf, cap=bounded_http.SMALL_FILE_BYTES,
                                  what=what, endpoint=endpoint, follow=True, plain=plain)
        hf_raise_for_status(bounded_http.as_response(answer))
        return answer.body

    data = hub_errors(what, get)
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    if s.blob_id and blob != s.blob_id:
        raise errors.ChecksumMismatch(
            f"{s.rfilename} from {endpoint} is not the git blob {s.blob_id} the Hub lists at "
            f"{manifest.revision} (got {blob}); try again, or another endpoint"
        )
    return hashlib.sha256(data).hexdigest()
