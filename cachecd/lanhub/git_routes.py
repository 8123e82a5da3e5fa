"""The hub's git-side routes, shaped as huggingface_hub parses them: ``list_repo_refs``
(``/refs``), ``list_repo_commits`` (``/commits/REV``), ``get_paths_info`` (``POST
/paths-info/REV``), ``list_repo_tree`` (``/tree/REV[/PATH]``, ``expand`` adding ``lastCommit`` and
``securityFileStatus``), and ``/raw/REV/PATH`` (a file as git holds it: an LFS file's pointer).

Invariants:
- Each revision folder is one branch at one commit with no history: ``/commits`` lists that one
  commit, and every entry's ``lastCommit`` is it. No tags, converts or pull requests exist.
- Listings are paged as the Hub pages them (1,000 entries, 50 with ``expand``), by a ``Link:
  <...>; rel="next"`` header huggingface_hub follows.
- A path reaches the filesystem only as a member of the snapshot's listing (``app``'s rule).
"""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web
from aiohttp.web_response import StreamResponse

from cachecd.lanhub.answers import bad_request, hf_error
from cachecd.lanhub.cdn import etag_matches
from cachecd.lanhub.repo import (
    RepoFile,
    RepoSnapshot,
    file_entry,
    iso_time,
    lfs_pointer,
    tree_json,
    valid_relpath,
)


class Hub(Protocol):
    """What these routes need of ``app``'s hub: a repo at a revision, its files, its branches."""

    async def snapshot(self, request: web.Request, rev: str = "main") -> RepoSnapshot: ...

    def entry(self, snap: RepoSnapshot, path: str) -> RepoFile: ...

    async def branches(self, request: web.Request) -> list[tuple[str, RepoSnapshot]]: ...

    async def git_file(self, request: web.Request, snap: RepoSnapshot, f: RepoFile,
                       headers: dict[str, str]) -> StreamResponse: ...

PAGE = 1000
PAGE_EXPANDED = 50
_MAX_PATHS = 1000
_TITLE = "Files served by cachecd hub serve"
# No scan runs here: "unscanned" is the Hub's word for a file it has not scanned.
_SECURITY = {"status": "unscanned", "avScan": {"virusFound": False, "virusNames": None},
             "pickleImportScan": None}


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true")


def last_commit(snap: RepoSnapshot) -> dict[str, str]:
    return {"id": snap.commit, "title": _TITLE, "date": iso_time(snap.last_modified)}


def _expanded(snap: RepoSnapshot, entry: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {"lastCommit": last_commit(snap)}
    if entry["type"] == "file":
        extra["securityFileStatus"] = _SECURITY
    return {**entry, **extra}


class GitRoutes:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def add(self, app: web.Application, repo: str, api: str) -> None:
        app.router.add_get(api + "/refs{slash:/?}", self.refs)
        app.router.add_get(api + "/commits/{rev}{slash:/?}", self.commits)
        app.router.add_post(api + "/paths-info/{rev}{slash:/?}", self.paths_info)
        app.router.add_get(api + "/tree/{rev}{tail:(/.*)?}", self.tree)
        for method in ("GET", "HEAD"):
            app.router.add_route(method, repo + "/raw/{rev}/{path:.+}", self.raw)

    async def refs(self, request: web.Request) -> StreamResponse:
        branches = []
        for name, snap in await self.hub.branches(request):
            branches.append({"name": name, "ref": f"refs/heads/{name}", "targetCommit": snap.commit})
        body: dict[str, Any] = {"branches": branches, "converts": [], "tags": []}
        if _truthy(request.rel_url.query.get("include_prs")):
            body["pullRequests"] = []
        return web.json_response(body)

    async def commits(self, request: web.Request) -> StreamResponse:
        snap = await self.hub.snapshot(request, request.match_info["rev"])
        item: dict[str, Any] = {
            "id": snap.commit,
            "authors": [{"user": snap.repo_id.split("/")[0], "avatar": None}],
            "date": iso_time(snap.last_modified),
            "title": _TITLE,
            "message": "",
        }
        if "formatted" in request.rel_url.query.getall("expand[]", []):
            item["formatted"] = {"title": f"<p>{_TITLE}</p>", "message": ""}
        return web.json_response([item])

    async def paths_info(self, request: web.Request) -> StreamResponse:
        snap = await self.hub.snapshot(request, request.match_info["rev"])
        if request.content_type == "application/json":
            data = await request.json()
            paths, expand = data.get("paths", []), bool(data.get("expand"))
            paths = paths if isinstance(paths, list) else [paths]
        else:
            form = await request.post()
            paths, expand = form.getall("paths", []), _truthy(str(form.get("expand", "")))
        if len(paths) > _MAX_PATHS:
            raise bad_request(f"at most {_MAX_PATHS} paths at a time, got {len(paths)}")
        out = []
        for path in dict.fromkeys(str(p).strip("/") for p in paths):
            entry = _path_entry(snap, path)
            if entry is not None:  # the Hub leaves out a path the revision does not have
                out.append(_expanded(snap, entry) if expand else entry)
        return web.json_response(out)

    async def tree(self, request: web.Request) -> StreamResponse:
        snap = await self.hub.snapshot(request, request.match_info["rev"])
        prefix = request.match_info["tail"].strip("/")
        if prefix and not valid_relpath(prefix):
            raise bad_request(f"Invalid path {prefix[:200]!r}")
        query = request.rel_url.query
        entries = tree_json(snap, prefix, _truthy(query.get("recursive")))
        if entries is None:
            raise hf_error(web.HTTPNotFound, "EntryNotFound",
                           f"{prefix[:200]!r} is not a folder of {snap.repo_id}",
                           {"X-Repo-Commit": snap.commit})
        expand = _truthy(query.get("expand"))
        size = PAGE_EXPANDED if expand else PAGE
        start = int(query["cursor"]) if query.get("cursor", "").isdigit() else 0
        page = entries[start:start + size]
        headers = {}
        if start + size < len(entries):
            url = request.url.update_query({"cursor": str(start + size)})
            headers["Link"] = f'<{url}>; rel="next"'
        body = [_expanded(snap, e) for e in page] if expand else page
        return web.json_response(body, headers=headers)

    async def raw(self, request: web.Request) -> StreamResponse:
        """The file as git has it: a plain file's bytes, an LFS file's pointer."""
        snap = await self.hub.snapshot(request, request.match_info["rev"])
        f = self.hub.entry(snap, request.match_info["path"])
        headers = {"X-Repo-Commit": snap.commit}
        if f.git_oid is None:
            pointer, oid = lfs_pointer(f)
            return _text(request, pointer, oid, headers)
        return await self.hub.git_file(request, snap, f, headers)


def _path_entry(snap: RepoSnapshot, path: str) -> dict[str, Any] | None:
    if not path or not valid_relpath(path):
        return None
    f: RepoFile | None = snap.files.get(path)
    if f is not None:
        return file_entry(f)
    parent, _, _ = path.rpartition("/")
    listing = tree_json(snap, parent, False)
    return next((e for e in listing or [] if e["path"] == path), None)


def _text(request: web.Request, data: bytes, oid: str, headers: dict[str, str]) -> StreamResponse:
    etag = f'"{oid}"'
    if etag_matches(request.headers.get("If-None-Match"), etag):
        raise web.HTTPNotModified(headers={**headers, "ETag": etag})
    return web.Response(body=data, content_type="text/plain", charset="utf-8",
                        headers={**headers, "ETag": etag})
