"""The HTTP side of the hub server: routes, auth, Hub-style errors, signed CDN URLs, ranges.

Model repos are ``DIR/{org}/{name}``, dataset repos ``DIR/datasets/{org}/{name}`` (the Hub's
``/datasets/...`` and ``/api/datasets/...`` routes); no model org is named ``datasets``.
The folder is the repo's ``main``; a sibling folder ``{name}@{rev}`` is its branch ``rev`` (a
new revision beside the old one), and each folder's commit resolves to that folder.

Invariants:
- No request path reaches the filesystem before it is validated: org and name match a strict
  pattern, file paths are relative with no ``..``/empty part/backslash/NUL, and a file is only
  ever served from the repo's own listing (so symlinks leaving the repo are never followed).
- ``/resolve`` answers a 302 with an absolute, HMAC-signed ``/_cdn`` URL on this server, and the
  Hub's metadata headers (X-Repo-Commit, X-Linked-Etag = quoted sha256, X-Linked-Size; for a
  file a download record says the Hub keeps in git, only ETag = its git blob id). The
  signed URL needs no token and expires; it serves only the bytes it was signed for: once its
  file changes (size or mtime) it answers 404 RevisionNotFound.
- ``/_cdn`` (``cdn``) honours one byte range exactly (206 + Content-Range, 416 past the end) and streams
  with sendfile; it never substitutes a pre-compressed sibling file. Its responses carry the
  same metadata headers, since huggingface_hub follows a same-origin redirect on HEAD.
- With a token configured, every request outside ``/_cdn`` needs ``Authorization: Bearer T``.
- A repo named gated answers every request outside ``/_cdn`` as the Hub answers a gated repo
  the token has no access to: 403 with ``X-Error-Code: GatedRepo``.
- Blocking work (walking, stat, hashing) runs in threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import quote

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from cachecd.lanhub.answers import bad_request, hf_error
from cachecd.lanhub.cdn import (
    DEFAULT_URL_TTL_S,
    ExactFileResponse,
    UrlSigner,
    etag_matches,
    unchanged,
    unsatisfiable,
)
from cachecd.lanhub.git_routes import GitRoutes
from cachecd.lanhub.limits import ResolveLimit
from cachecd.lanhub.mirror import sidecar_path
from cachecd.lanhub.repo import (
    SHARED_HASHES,
    HashCache,
    RepoFile,
    RepoSnapshot,
    model_info_json,
    snapshot,
    valid_relpath,
)
from cachecd.lanhub.xet_routes import CAS_PREFIX, XORB_PREFIX, XetSide
from cachecd.manifest.repo_ref import REVISION, valid_part

log = logging.getLogger("cachecd.lanhub.server")

_SIGNED_SNAPSHOTS = 64
_REVISION = re.compile(REVISION)
_COMMIT_PREFIX = re.compile(r"[0-9a-f]{7,39}")
_Handler = Callable[[web.Request], Awaitable[StreamResponse]]
DATASETS = "datasets"


# ---------------------------------------------------------------- the app


class _Hub:
    """Request handlers over one root folder."""

    def __init__(self, root: Path, token: str | None, signer: UrlSigner, hashes: HashCache,
                 gated: frozenset[str] = frozenset(), limit: ResolveLimit | None = None,
                 xet: XetSide | None = None) -> None:
        self.root = root.resolve()
        self.xet = xet  # None: the LFS route only (repos not on Xet)
        self.limit = limit
        self.token = token
        self.gated = gated
        self.signer = signer
        self.hashes = hashes
        # Snapshots this server signed URLs from, newest last: the CDN's fast path.
        self.signed: OrderedDict[tuple[str, str], RepoSnapshot] = OrderedDict()

    async def snapshot(self, request: web.Request, rev: str = "main") -> RepoSnapshot:
        """The repo at ``rev``: ``main`` is the folder ``ORG/NAME``; a branch or tag ``REV`` is
        the sibling folder ``ORG/NAME@REV``; a commit is whichever of them is at that commit."""
        org, name = request.match_info["org"], request.match_info["name"]
        repo_id = f"{org}/{name}"
        # DIR/datasets/ holds the dataset repos, so no model org is named "datasets" (as on HF).
        kind = request.match_info.get("kind", "")
        if not (valid_part(org) and valid_part(name)) or (not kind and org == DATASETS):
            raise hf_error(web.HTTPNotFound, "RepoNotFound", f"Repository {repo_id!r} not found")
        if repo_id in self.gated:
            raise hf_error(web.HTTPForbidden, "GatedRepo",
                            f"Access to model {repo_id} is restricted and you are not in the "
                            f"authorized list. Visit {request.url.origin()}/{repo_id} to ask for "
                            "access.")
        repo_dir = self.root / kind / org / name
        snap = await asyncio.to_thread(self._snapshot_at, repo_dir, repo_id,
                                       _repo_key(request), rev)
        if snap is None:
            raise hf_error(web.HTTPNotFound, "RepoNotFound", f"Repository {repo_id!r} not found")
        if self.xet is not None:
            snap = await asyncio.to_thread(self.xet.annotate, snap)
        return snap

    def _snapshot_at(self, repo_dir: Path, repo_id: str, key: str,
                     rev: str) -> RepoSnapshot | None:
        """None: no such repo; RevisionNotFound: the repo has no ``rev``."""
        folders = revision_folders(repo_dir)
        if rev in folders:
            return self._snapshot_if_repo(folders[rev], repo_id, f"{key}@{rev}")
        main = self._snapshot_if_repo(repo_dir, repo_id, key)
        if rev == "main" or (main is not None and main.commit == rev):
            return main
        snaps = [main] + [self._snapshot_if_repo(folder, repo_id, f"{key}@{branch}")
                          for branch, folder in folders.items()]
        found = [s for s in snaps if s is not None and s.commit == rev]
        if not found and _COMMIT_PREFIX.fullmatch(rev):  # a short commit, as git takes one
            found = [s for s in snaps if s is not None and s.commit.startswith(rev)]
        if len({s.commit for s in found}) == 1:
            return found[0]
        if main is None and not folders:
            return None
        known = ["main"] * (main is not None) + sorted(folders)
        raise hf_error(
            web.HTTPNotFound,
            "RevisionNotFound",
            f"Revision {rev[:64]!r} not found in {repo_id}: use one of {', '.join(known)} or "
            f"their commits",
        )

    def _snapshot_if_repo(self, repo_dir: Path, repo_id: str, key: str) -> RepoSnapshot | None:
        real = repo_dir.resolve()
        if not real.is_relative_to(self.root) or not real.is_dir():
            return None
        return snapshot(real, repo_id, self.hashes, sidecar_path(self.root, key))

    @staticmethod
    def entry(snap: RepoSnapshot, path: str) -> RepoFile:
        if not valid_relpath(path):
            raise bad_request(f"Invalid file path {path[:200]!r}")
        found = snap.files.get(path)
        if found is None:
            raise hf_error(
                web.HTTPNotFound,
                "EntryNotFound",
                f"{path[:200]!r} not found in {snap.repo_id}",
                {"X-Repo-Commit": snap.commit},
            )
        return found

    @staticmethod
    def file_headers(snap: RepoSnapshot, f: RepoFile) -> dict[str, str]:
        if f.git_oid is not None:  # as the Hub answers for a file in git: its blob id, no X-Linked
            return {"X-Repo-Commit": snap.commit, "ETag": f'"{f.git_oid}"',
                    "Accept-Ranges": "bytes"}
        return {
            "X-Repo-Commit": snap.commit,
            "X-Linked-Etag": f'"{f.sha256}"',
            "X-Linked-Size": str(f.size),
            "Accept-Ranges": "bytes",
        }

    async def resolve(self, request: web.Request) -> StreamResponse:
        """302 to a signed ``/_cdn`` URL, or 304 when ``If-None-Match`` names the file's ETag;
        counted against ``limit`` (429 past it), whose headers every answer carries."""
        if self.limit is None:
            return await self._resolve(request)
        verdict = self.limit.check(request.remote or "", request.headers.get("Authorization", ""))
        if not verdict.allowed:
            raise hf_error(web.HTTPTooManyRequests, None,
                           "You have exceeded the rate limit for /resolve requests: wait for the "
                           "time RateLimit gives (t=SECONDS)", verdict.headers)
        try:
            response = await self._resolve(request)
        except web.HTTPException as exc:
            exc.headers.update(verdict.headers)
            raise
        response.headers.update(verdict.headers)
        return response

    async def _resolve(self, request: web.Request) -> StreamResponse:
        snap = await self.snapshot(request, request.match_info["rev"])
        f = self.entry(snap, request.match_info["path"])
        key = _repo_key(request)
        headers = {"ETag": f'"{f.sha256}"', **self.file_headers(snap, f),
                   **XetSide.file_headers(request, snap, f)}
        if etag_matches(request.headers.get("If-None-Match"), headers["ETag"]):
            raise web.HTTPNotModified(headers=headers)
        self.remember(key, snap)
        resource = f"{key}/{snap.commit}/{f.relpath}"
        origin = str(request.url.origin())
        location = f"{origin}/_cdn/{key}/{snap.commit}/{quote(f.relpath)}"
        raise web.HTTPFound(f"{location}?{self.signer.query(resource)}", headers=headers)

    async def cdn(self, request: web.Request) -> StreamResponse:
        info = request.match_info
        resource = f"{_repo_key(request)}/{info['commit']}/{info['path']}"
        query = request.rel_url.query
        if not self.signer.valid(resource, query.get("expires", ""), query.get("sig", "")):
            raise hf_error(
                web.HTTPForbidden, None, "Signed URL is invalid or expired: resolve again"
            )
        snap, f = await self.signed_file(request, info["commit"], info["path"])
        if "If-Range" not in request.headers and unsatisfiable(
            request.headers.get("Range"), f.size
        ):
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{f.size}"})
        headers = {**self.file_headers(snap, f), **XetSide.file_headers(request, snap, f)}
        etag = f'"{f.git_oid or f.sha256}"'
        if etag_matches(request.headers.get("If-None-Match"), etag):
            raise web.HTTPNotModified(headers={**headers, "ETag": etag})
        response = ExactFileResponse(f.real, f.git_oid or f.sha256)
        response.content_type = "application/octet-stream"
        response.headers.update(headers)
        return response

    async def signed_file(
        self, request: web.Request, commit: str, path: str
    ) -> tuple[RepoSnapshot, RepoFile]:
        """The file a signed URL names, as long as its bytes are the ones that were signed.

        Fast path: the snapshot this server signed from, and one stat showing the file untouched
        (a CDN URL names content, so other files changing does not matter). Otherwise the repo is
        walked again and must still be at ``commit``.
        """
        key = _repo_key(request)
        snap = self.signed.get((key, commit))
        f = snap.files.get(path) if snap is not None else None
        if snap is not None and f is not None and await asyncio.to_thread(unchanged, f):
            return snap, f
        snap = await self.snapshot(request, commit)
        if snap.commit != commit:
            raise hf_error(
                web.HTTPNotFound,
                "RevisionNotFound",
                f"{snap.repo_id} changed since this URL was signed: resolve again",
            )
        self.remember(key, snap)
        return snap, self.entry(snap, path)

    def remember(self, key: str, snap: RepoSnapshot) -> None:
        self.signed[(key, snap.commit)] = snap
        self.signed.move_to_end((key, snap.commit))
        while len(self.signed) > _SIGNED_SNAPSHOTS:
            self.signed.popitem(last=False)

    async def xet_token(self, request: web.Request) -> StreamResponse:
        """A CAS read token scoped to the repo at ``rev`` (which must exist)."""
        assert self.xet is not None
        snap = await self.snapshot(request, request.match_info["rev"])
        return self.xet.token_answer(request, _repo_key(request), snap.commit)

    async def model_info(self, request: web.Request) -> StreamResponse:
        snap = await self.snapshot(request, request.match_info.get("rev", "main"))
        return web.json_response(model_info_json(snap))

    async def branches(self, request: web.Request) -> list[tuple[str, RepoSnapshot]]:
        """(name, snapshot) of ``main`` and each ``NAME@REV`` folder that is a repo."""
        main = await self.snapshot(request)
        key = _repo_key(request)
        folders = revision_folders(self.root / request.match_info.get("kind", "") / main.repo_id)

        def walk() -> list[tuple[str, RepoSnapshot]]:
            out = [("main", main)]
            for name, folder in folders.items():
                snap = self._snapshot_if_repo(folder, main.repo_id, f"{key}@{name}")
                out += [(name, snap)] if snap is not None else []
            return out

        return await asyncio.to_thread(walk)

    async def git_file(self, request: web.Request, snap: RepoSnapshot, f: RepoFile,
                       headers: dict[str, str]) -> StreamResponse:
        """A file kept in git, served here by its blob id (``/raw``)."""
        etag = f'"{f.git_oid}"'
        if etag_matches(request.headers.get("If-None-Match"), etag):
            raise web.HTTPNotModified(headers={**headers, "ETag": etag})
        if not await asyncio.to_thread(unchanged, f):
            raise hf_error(web.HTTPNotFound, "EntryNotFound",
                           f"{f.relpath!r} changed while being served: ask again")
        response = ExactFileResponse(f.real, f.git_oid)
        response.content_type = "text/plain"
        response.headers.update(headers)
        return response

    @web.middleware
    async def auth(self, request: web.Request, handler: _Handler) -> StreamResponse:
        # The CDN's URLs are signed; the CAS's calls carry a Xet token (checked by XetSide).
        if self.token is None or request.path.startswith(("/_cdn/", CAS_PREFIX + "/",
                                                          XORB_PREFIX + "/")):
            return await handler(request)
        given = request.headers.get("Authorization", "")
        if not given:
            raise hf_error(
                web.HTTPUnauthorized,
                "GatedRepo",
                "Access to this server is restricted: pass its token as HF_TOKEN",
            )
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            # The Hub's own wording: huggingface_hub keys its "invalid token" message on it.
            raise hf_error(
                web.HTTPUnauthorized, None, "Invalid credentials in Authorization header"
            )
        return await handler(request)


HUB_KEY: web.AppKey[_Hub] = web.AppKey("hub", _Hub)


def build_app(
    root: Path,
    *,
    token: str | None = None,
    url_ttl_s: float = DEFAULT_URL_TTL_S,
    hashes: HashCache | None = None,
    gated: frozenset[str] = frozenset(),
    limit: ResolveLimit | None = None,
    xet: XetSide | None = None,
) -> web.Application:
    """The hub over ``root``. Servers share the process-wide sha256 cache unless given their own,
    so a server restarted in the same process does not hash again. ``xet``: serve large files
    through Xet as well (None: the LFS route only)."""
    hub = _Hub(root, token, UrlSigner(url_ttl_s), hashes or SHARED_HASHES, gated, limit, xet)
    app = web.Application(middlewares=[hub.auth])
    app[HUB_KEY] = hub
    routes = GitRoutes(hub)
    # Dataset routes first: "/datasets/..." is a dataset repo, never a model org.
    for kind, api in (("/{kind:datasets}", "/api/{kind:datasets}"), ("", "/api/models")):
        repo = kind + "/{org}/{name}"
        api += "/{org}/{name}"
        for method in ("GET", "HEAD"):
            app.router.add_route(method, "/_cdn" + repo + "/{commit}/{path:.+}", hub.cdn)
            app.router.add_route(method, repo + "/resolve/{rev}/{path:.+}", hub.resolve)
        app.router.add_get(api + "{slash:/?}", hub.model_info)
        app.router.add_get(api + "/revision/{rev}{slash:/?}", hub.model_info)
        routes.add(app, repo, api)
        if xet is not None:
            app.router.add_get(api + "/xet-read-token/{rev}{slash:/?}", hub.xet_token)
    if xet is not None:
        app.router.add_get(CAS_PREFIX + "/{v:v[12]}/reconstructions/{hash}", xet.reconstruction)
        app.router.add_get(CAS_PREFIX + "/v2/file-chunk-hashes/{hash}", xet.chunk_hashes)
        app.router.add_get(XORB_PREFIX + "/{hash}", xet.xorb)
    return app


def revision_folders(repo_dir: Path) -> dict[str, Path]:
    """``REV -> DIR/ORG/NAME@REV``: the other revisions served beside the folder ``ORG/NAME``."""
    prefix = repo_dir.name + "@"
    try:
        entries = list(repo_dir.parent.iterdir())
    except OSError:
        return {}
    return {e.name[len(prefix):]: e for e in sorted(entries)
            if e.name.startswith(prefix) and _REVISION.fullmatch(e.name[len(prefix):])}


def _repo_key(request: web.Request) -> str:
    """``org/name`` for a model repo, ``datasets/org/name`` for a dataset repo."""
    repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
    kind = request.match_info.get("kind")
    return f"{kind}/{repo_id}" if kind else repo_id


class AccessLog(AbstractAccessLogger):
    """One DEBUG line per request; the query (with its signature) stays out of the log."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        self.logger.debug(
            "request method=%s path=%s status=%d bytes=%d ms=%.1f",
            request.method,
            request.rel_url.raw_path,
            response.status,
            response.body_length,
            time * 1000,
        )

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.DEBUG)
