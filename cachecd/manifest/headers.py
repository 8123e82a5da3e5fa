"""The safetensors headers of a manifest's shards at its pinned commit: fetched by range, kept.

What the layout check (``layout_check``) compares a manifest with. Per shard: one HEAD of its
``/resolve`` at the pinned commit, redirects not followed (the Hub's size, sha256 and signed
location; a commit, size or sha256 that is not the manifest's is a ``ManifestMismatch``), then
the first 8 + N bytes by one Range request (206 with the exact Content-Range) to that location,
without the token when it is elsewhere (as the daemon's own fetches: the token goes to
``/resolve`` only), which must parse as a header whose tensors tile the data section
up to the file's size. For K3: 96 shards, each header under 1 MiB.

A header whose transfer failed, or whose bytes are not a header of a file of that size, is
asked for again (``ATTEMPTS``). Headers that refute a manifest are read a second time first
(``confirm_fresh``): bytes that change between reads are the endpoint's fault, not the
manifest's.

Kept under ``keep`` as ``<endpoint>-<sha256>.header``, once the check they served has passed:
addressed by the endpoint they came from (``endpoint_id``) and the content of the shard, as that
endpoint vouched for it (X-Linked-Etag), so a kept header is the same for every repo and revision
holding that shard at that endpoint, and a later check there (another registration, a daemon
offline) needs no network. Only the endpoint that vouched for it: a mirror that names the real
sha256 but serves a header with two tensor names exchanged could otherwise approve a swapped
manifest later checked against an honest endpoint (docs/trust.md). A kept header is parsed and
checked against the size again when read; one that fails is fetched again.

The Hub limits ``/resolve`` per window (``RateLimit: "resolvers";r=R;t=T``): once an answer says
none are left (r=0, or a 429), no HEAD to that endpoint starts before its T seconds have passed,
in any thread; a 429 is asked again after that wait (``RATE_WAITS`` times) without counting as a
failed attempt.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

from cachecd import constants, errors
from cachecd.durable import write_atomic
from cachecd.manifest.bounded_http import check_redirect
from cachecd.manifest.entries import FileInfo
from cachecd.manifest.manifest import Manifest
from cachecd.manifest.safetensors_header import header_length, parse_header_columns
from cachecd.manifest.source import hub_errors, read_first_bytes

log = logging.getLogger(__name__)

PROBE_BYTES = 1024 * 1024  # one Range request covers a K3 shard's header (< 1 MiB)
PARALLEL = 8
ATTEMPTS = 5  # per header, on a transfer that failed or bytes that are not a header
BACKOFF_S = 0.2
_REDIRECTS = (301, 302, 303, 307, 308)
_SHA256 = re.compile(r"[0-9a-f]{64}")


def endpoint_id(endpoint: str) -> str:
    """A kept header's endpoint, in its file name: the first 16 hex of the sha256 of its URL."""
    return hashlib.sha256(endpoint.rstrip("/").encode()).hexdigest()[:16]


def keep_dir(models_dir: Path) -> Path:
    """Where setup and the daemon keep headers: beside the daemon's copies of manifests."""
    return models_dir / "manifests" / "headers"


@dataclass
class Headers:
    """Every shard's header bytes, and which of them were fetched now (not kept), each with
    whether the endpoint vouched for its shard's sha256 (only those may be kept)."""

    of: dict[str, bytes]
    fresh: dict[str, bool] = field(default_factory=dict)


def shard_headers(manifest: Manifest, *, endpoint: str, token: str | None = None,
                  keep: Path | None = None, offline: bool = False, retry: bool = True,
                  parallel: int = PARALLEL, deadline_s: float | None = None) -> Headers:
    """Every shard's header bytes, kept ones first; the rest fetched, ``parallel`` at a time
    (``Offline`` when ``offline`` and some are not kept; without ``retry`` a failed read is
    asked again once, not ``ATTEMPTS - 1`` times; ``UpstreamTimeout`` past ``deadline_s``).
    huggingface_hub's one HTTP client keeps its connections open afterwards: a long-running
    process asks for 1. Nothing is kept here: the
    caller keeps fresh headers once the check they served has passed (``keep_fresh``)."""
    out = Headers({name: head for name in manifest.shards
                   if (head := kept(keep, manifest.files[name], endpoint)) is not None})
    missing = [manifest.files[name] for name in manifest.shards if name not in out.of]
    if missing and offline:
        raise errors.Offline(
            f"{manifest.key}: the safetensors headers of {len(missing)} shards "
            f"({missing[0].name}, ...) are not kept here and HF_HUB_OFFLINE is set, so its "
            f"manifest's expert layout cannot be checked; unset HF_HUB_OFFLINE once")
    if missing:
        fetched = _fetch_all(manifest, missing, endpoint.rstrip("/"), token, retry, parallel,
                             deadline_s)
        for name, (head, vouched) in fetched.items():
            out.of[name], out.fresh[name] = head, vouched
    return out


def confirm_fresh(manifest: Manifest, headers: Headers, *, endpoint: str,
                  token: str | None = None, parallel: int = PARALLEL,
                  deadline_s: float | None = None) -> None:
    """Before fresh headers are taken to refute a manifest: read them again, and raise
    ``BadUpstreamRange`` if any came back otherwise (the endpoint, or something between, changed
    bytes: a fault, not the manifest's)."""
    files = [manifest.files[name] for name in headers.fresh]
    again = _fetch_all(manifest, files, endpoint.rstrip("/"), token, True, parallel, deadline_s)
    differ = [name for name, (head, _) in again.items() if head != headers.of[name]]
    if differ:
        raise errors.BadUpstreamRange(
            f"{manifest.key}/{differ[0]}: {endpoint} served two different safetensors headers "
            f"for it; try again, or another endpoint")


def keep_fresh(keep: Path | None, manifest: Manifest, headers: Headers, endpoint: str) -> None:
    """Keep the fresh headers ``endpoint`` vouched for, by it and their shard's sha256."""
    if keep is None:
        return
    for name, vouched in headers.fresh.items():
        if vouched:
            _keep(keep, manifest.files[name], headers.of[name], endpoint)


def _kept_path(keep: Path, f: FileInfo, endpoint: str) -> Path:
    return keep / f"{endpoint_id(endpoint)}-{f.sha256}.header"


def kept(keep: Path | None, f: FileInfo, endpoint: str) -> bytes | None:
    """The header ``endpoint`` served and vouched for of the shard whose sha256 is ``f.sha256``,
    if kept and it checks against its size."""
    if keep is None:
        return None
    try:
        head = _kept_path(keep, f, endpoint).read_bytes()
        parse_header_columns(head, f.size, f.name)
    except (OSError, errors.ManifestInvalid):
        return None
    return head


def _keep(keep: Path, f: FileInfo, head: bytes, endpoint: str) -> None:
    try:
        keep.mkdir(parents=True, exist_ok=True)
        write_atomic(_kept_path(keep, f, endpoint), head)
    except OSError as exc:  # a read-only models dir: the check still ran, it is only not kept
        log.warning("header_not_kept file=%s dir=%s err=%s", f.name, keep, exc)


def _fetch_all(manifest: Manifest, files: Iterable[FileInfo], endpoint: str, token: str | None,
               retry: bool, parallel: int, deadline_s: float | None = None
               ) -> dict[str, tuple[bytes, bool]]:
    from huggingface_hub import get_session
    from huggingface_hub.utils import build_hf_headers

    session, hf = get_session(), build_hf_headers(token=token)
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    attempts = ATTEMPTS if retry else 2
    files = list(files)
    with ThreadPoolExecutor(max(1, min(parallel, len(files)))) as pool:
        results = pool.map(
            lambda f: _fetch(manifest, f, endpoint, session, hf, attempts, deadline), files)
        return dict(zip((f.name for f in files), results, strict=True))


def _fetch(manifest: Manifest, f: FileInfo, endpoint: str, session: Any, hf: dict[str, str],
           attempts: int, deadline: float | None) -> tuple[bytes, bool]:
    """(header bytes, whether the endpoint vouched for the shard's sha256), asked again when
    the transfer failed or the bytes are not a header of a file of its size."""
    for attempt in range(1, attempts + 1):
        if deadline is not None and time.monotonic() > deadline:
            raise errors.UpstreamTimeout(
                f"{manifest.key}/{f.name}: its safetensors header was not read in time; try "
                f"again later")
        try:
            return _fetch_once(manifest, f, endpoint, session, hf)
        except (errors.UpstreamError, errors.BadUpstreamRange) as exc:
            if attempt == attempts:
                raise
            log.info("header_retry file=%s attempt=%d err=%s", f.name, attempt, exc.message)
            time.sleep(BACKOFF_S * attempt)
    raise AssertionError("unreachable")


def _fetch_once(manifest: Manifest, f: FileInfo, endpoint: str, session: Any,
                hf: dict[str, str]) -> tuple[bytes, bool]:
    from huggingface_hub import hf_hub_url

    what = f"{manifest.repo}@{manifest.revision}/{f.name}"
    url = hf_hub_url(manifest.repo, f.name, revision=manifest.revision, endpoint=endpoint)
    location, redirected, said = _resolve(session, url, hf, what)
    vouched = _check_identity(manifest, f, said, endpoint)
    # The token goes to the endpoint's /resolve only, never where it redirects (a CDN host).
    plain = {k: v for k, v in hf.items() if k.lower() != "authorization"}
    headers = {"Accept-Encoding": "identity", **(plain if redirected else hf)}
    head = read_first_bytes(session, location, headers, min(f.size, PROBE_BYTES), f.size, what)
    n = header_length(head, what)
    if 8 + n > len(head):
        head = read_first_bytes(session, location, headers, 8 + n, f.size, what)
    head = head[: 8 + n]
    try:
        parse_header_columns(head, f.size, what)
    except errors.ManifestInvalid as exc:
        raise errors.BadUpstreamRange(
            f"{what}: {endpoint} served a header that does not describe a file of {f.size} "
            f"bytes ({exc.message}); try again, or another endpoint") from exc
    return head, vouched


def _resolve(session: Any, url: str, hf: dict[str, str],
             what: str) -> tuple[str, bool, dict[str, str]]:
    """One HEAD of ``/resolve``, redirects not followed (the daemon's rule): where the bytes
    are, whether that is elsewhere, and what the endpoint says of the file (commit, size, etag)."""
    from huggingface_hub.utils import hf_raise_for_status

    pace = _pace(url)

    def head() -> Any:
        for _ in range(RATE_WAITS + 1):
            pace.wait()
            resp = session.head(url, headers={**hf, "Accept-Encoding": "identity"},
                                follow_redirects=False, timeout=constants.READ_TIMEOUT_S)
            if not pace.told(resp.headers) or resp.status_code != 429:
                break
            log.info("header_rate_limited file=%s", what)
        if resp.status_code not in _REDIRECTS:
            hf_raise_for_status(resp)
        return resp

    resp = hub_errors(what, head)
    h = resp.headers
    said = {"commit": h.get("X-Repo-Commit") or "",
            "size": h.get("X-Linked-Size") or ("" if resp.status_code in _REDIRECTS
                                               else h.get("Content-Length") or ""),
            "etag": (h.get("X-Linked-Etag") or h.get("ETag") or "").removeprefix("W/")
            .strip('"').lower()}
    if resp.status_code in _REDIRECTS and h.get("Location"):
        return check_redirect(url, urljoin(url, h["Location"]), what), True, said
    return url, False, said


def _check_identity(manifest: Manifest, f: FileInfo, said: dict[str, str], endpoint: str) -> bool:
    """The HEAD's commit, size and sha256 must be the manifest's; True if it gave a sha256."""
    where = f"{f.name} at {manifest.revision} on {endpoint}"
    if said["commit"] and said["commit"] != manifest.revision:
        raise errors.ManifestMismatch(
            f"{manifest.source}: {where} answered for commit {said['commit']}: the manifest "
            f"pins a commit the endpoint does not serve as such")
    if said["size"].isdigit() and int(said["size"]) != f.size:
        raise errors.ManifestMismatch(
            f"{manifest.source}: {f.name}: size {f.size} in the manifest, {said['size']} on "
            f"{endpoint}: build one (cachecd manifest build {manifest.key}) or get it again")
    etag = said["etag"]
    if _SHA256.fullmatch(etag) and etag != f.sha256:
        raise errors.ManifestMismatch(
            f"{manifest.source}: {f.name}: sha256 {f.sha256} in the manifest, {etag} on "
            f"{endpoint}: build one (cachecd manifest build {manifest.key}) or get it again")
    return bool(_SHA256.fullmatch(etag))


RATE_WAITS = 3


class _Pace:
    """When the next ``/resolve`` to one endpoint may start, as its RateLimit header said."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._not_before = 0.0

    def wait(self) -> None:
        with self._lock:
            delay = self._not_before - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def told(self, headers: Any) -> bool:
        """Whether the answer said the window is spent; then later HEADs wait for the next."""
        from huggingface_hub.utils import parse_ratelimit_headers

        info = parse_ratelimit_headers(headers)
        if info is None or info.remaining > 0:
            return False
        with self._lock:
            self._not_before = max(self._not_before, time.monotonic() + info.reset_in_seconds)
        return True


_PACES: dict[str, _Pace] = {}
_PACES_LOCK = threading.Lock()


def _pace(url: str) -> _Pace:
    parts = urlsplit(url)
    with _PACES_LOCK:
        return _PACES.setdefault(f"{parts.scheme}://{parts.netloc}", _Pace())
