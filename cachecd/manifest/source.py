"""Where ``build`` reads a repo from: a Hub endpoint (HTTP) or a local folder.

Hub invariants: the revision is resolved ONCE to a 40-hex commit (X-Repo-Commit) and every
later request names that commit; the token goes only to the endpoint's own origin (a signed
CDN location gets no Authorization header); a header read insists on 206 with the exact
Content-Range; each shard is streamed with ONE GET, Accept-Encoding: identity.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from cachecd import constants, errors
from cachecd.hub_errors import translate
from cachecd.manifest.build_plan import HEX64, SourceFile

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
T = TypeVar("T")


class LocalSource:
    """A folder laid out like a repo; the caller names the revision (no sha256 to check)."""

    requires_sha256 = False

    def __init__(self, root: Path, repo: str, revision: str) -> None:
        self.root, self.repo, self.revision = Path(root), repo, revision

    def list_files(self) -> list[SourceFile]:
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in filenames:
                if name.startswith("."):
                    continue
                path = Path(dirpath, name)
                out.append(
                    SourceFile(path.relative_to(self.root).as_posix(), path.stat().st_size, None)
                )
        return sorted(out, key=lambda f: f.name)

    def read_head(self, name: str, nbytes: int) -> bytes:
        with open(self.root / name, "rb") as f:
            return f.read(nbytes)

    def stream(self, name: str, start: int = 0) -> Iterator[bytes]:
        with open(self.root / name, "rb") as f:
            f.seek(start)
            while chunk := f.read(CHUNK_BYTES):
                yield chunk


def _same_origin(url: str, base: str) -> bool:
    a, b = urlsplit(url), urlsplit(base)
    return (a.scheme, a.netloc) == (b.scheme, b.netloc)


def request_headers(url: str, endpoint: str, hf_headers: dict[str, str],
                    extra: dict[str, str]) -> dict[str, str]:
    """Identity encoding, and huggingface_hub's headers: the token only to the endpoint's own
    origin, never to a CDN host a signed location points at."""
    headers = {"Accept-Encoding": "identity", **extra}
    if _same_origin(url, endpoint):
        headers.update(hf_headers)
    else:
        headers.update({k: v for k, v in hf_headers.items() if k.lower() != "authorization"})
    return headers


def read_first_bytes(session: Any, url: str, headers: dict[str, str], nbytes: int,
                     size: int | None, what: str) -> bytes:
    """The first ``nbytes`` of a file by one Range GET: insists on 206 with exactly
    ``bytes 0-(nbytes-1)/size`` and that many bytes, checked before the body is read, and the
    body read within ``nbytes`` (``bounded_http``: a padded or compressed one stops there)."""
    from cachecd.manifest.bounded_http import read_body

    rng = f"bytes=0-{nbytes - 1}"
    want = f"bytes 0-{nbytes - 1}/{size if size is not None else ''}"
    try:
        with session.stream("GET", url, headers={**headers, "Range": rng},
                            follow_redirects=False, timeout=constants.READ_TIMEOUT_S) as resp:
            got = resp.headers.get("Content-Range", "")
            if resp.status_code != 206 or not got.startswith(want):
                raise errors.BadUpstreamRange(
                    f"{what}: asked {rng}, got HTTP {resp.status_code} Content-Range {got!r}")
            try:
                body = read_body(resp, nbytes, what, constants.READ_TIMEOUT_S * 2)
            except errors.UpstreamAnswerInvalid as exc:
                raise errors.BadUpstreamRange(f"{what}: for {rng}: {exc.message}") from None
    except errors.CachecdError:
        raise
    except Exception as exc:  # httpx transport errors
        raise errors.UpstreamError(f"{what}: {type(exc).__name__}: {exc}") from exc
    if len(body) != nbytes:
        raise errors.BadUpstreamRange(f"{what}: {len(body)} bytes for {rng}")
    return body


def hub_errors(what: str, fn: Callable[[], T]) -> T:
    """Run an huggingface_hub call, its Hub and network errors raised as cachecd's."""
    try:
        return fn()
    except Exception as exc:
        typed = translate(exc, what)
        if typed is None and isinstance(exc, OSError):  # a local write failed under the call
            typed = errors.UpstreamError(f"{what}: {type(exc).__name__}: {exc}")
        if typed is None or typed is exc:
            raise
        raise typed from exc


class HubSource:
    """A model repo on an HF-compatible endpoint, pinned to the commit ``rev`` resolves to."""

    requires_sha256 = True  # every shard is checked against the hub's X-Linked-Etag

    def __init__(
        self, repo: str, rev: str = "main", *, endpoint: str | None = None, token: str | None = None
    ) -> None:
        from huggingface_hub import HfApi, get_hf_file_metadata, get_session, hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        self.repo = repo
        self.endpoint = (endpoint or constants.HF_ENDPOINT).rstrip("/")
        self._token = token
        self._headers: dict[str, str] = build_hf_headers(token=token)
        self._url = lambda name, rev: hf_hub_url(repo, name, revision=rev, endpoint=self.endpoint)
        self._meta = get_hf_file_metadata
        self._session: Any = get_session()
        self._api = HfApi(endpoint=self.endpoint, token=token)
        head = self._head("config.json", rev)
        commit = head.commit_hash or ""
        if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
            raise errors.UpstreamError(f"{repo}@{rev}: the endpoint gave no commit (X-Repo-Commit)")
        self.revision = commit
        self._locations: dict[str, str] = {}
        self._sizes: dict[str, int] = {}

    def _head(self, name: str, rev: str) -> Any:
        return hub_errors(
            f"{self.repo}@{rev}/{name}",
            lambda: self._meta(
                self._url(name, rev),
                token=self._token,
                endpoint=self.endpoint,
                retry_on_errors=True,
            ),
        )

    def list_files(self) -> list[SourceFile]:
        from huggingface_hub.hf_api import RepoFile

        entries = hub_errors(
            f"{self.repo}@{self.revision}: list files",
            lambda: list(
                self._api.list_repo_tree(self.repo, revision=self.revision, recursive=True)
            ),
        )
        out = []
        for e in entries:
            if isinstance(e, RepoFile):
                out.append(self._file(e.path, int(e.size), e.lfs.sha256 if e.lfs else None))
        return sorted(out, key=lambda f: f.name)

    def _file(self, name: str, size: int, lfs_sha: str | None) -> SourceFile:
        """One HEAD per file: its signed location and the hub's sha256 (X-Linked-Etag)."""
        meta = self._head(name, self.revision)
        if meta.commit_hash and meta.commit_hash != self.revision:
            raise errors.UpstreamError(f"{self.repo}/{name}: commit changed under the build")
        if meta.size is not None and meta.size != size:
            raise errors.UpstreamError(
                f"{self.repo}/{name}: tree says {size} bytes, HEAD {meta.size}"
            )
        self._locations[name] = meta.location
        self._sizes[name] = size
        etag = (meta.etag or "").lower()
        sha = etag if HEX64.fullmatch(etag) else lfs_sha
        if lfs_sha and sha != lfs_sha:
            raise errors.ChecksumMismatch(
                f"{self.repo}/{name}: X-Linked-Etag {etag} != LFS oid {lfs_sha}"
            )
        return SourceFile(name, size, sha)

    def _location(self, name: str) -> str:
        if name not in self._locations:
            self._file(name, self._head(name, self.revision).size or 0, None)
        return self._locations[name]

    def _request_headers(self, url: str, extra: dict[str, str]) -> dict[str, str]:
        return request_headers(url, self.endpoint, self._headers, extra)

    def read_head(self, name: str, nbytes: int) -> bytes:
        url = self._location(name)
        return read_first_bytes(self._session, url, self._request_headers(url, {}), nbytes,
                                self._sizes.get(name), f"{self.repo}/{name}")

    def stream(self, name: str, start: int = 0) -> Iterator[bytes]:
        """The file from byte ``start`` on: 200 for the whole file, else 206 with exactly
        ``bytes start-(size-1)/size`` (a build resumes a broken shard this way)."""
        url = self._location(name)
        extra = {"Range": f"bytes={start}-"} if start else {}
        try:
            with self._session.stream(
                "GET",
                url,
                headers=self._request_headers(url, extra),
                follow_redirects=False,
                timeout=constants.READ_TIMEOUT_S,
            ) as resp:
                size = self._sizes.get(name)
                want = f"bytes {start}-{size - 1}/{size}" if size else None
                if start and (resp.status_code != 206 or resp.headers.get("Content-Range") != want):
                    raise errors.UpstreamError(
                        f"{self.repo}/{name}: asked bytes={start}-, got HTTP {resp.status_code} "
                        f"Content-Range {resp.headers.get('Content-Range')!r}"
                    )
                if not start and resp.status_code != 200:
                    raise errors.UpstreamError(
                        f"{self.repo}/{name}: GET answered HTTP {resp.status_code}"
                    )
                yield from resp.iter_bytes(CHUNK_BYTES)
        except errors.CachecdError:
            self._locations.pop(name, None)  # a retry re-resolves (the signature may have expired)
            raise
        except Exception as exc:  # httpx transport and protocol errors
            self._locations.pop(name, None)
            raise errors.UpstreamError(f"{self.repo}/{name}: {type(exc).__name__}: {exc}") from exc
