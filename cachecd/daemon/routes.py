"""The HTTP/JSON control API on the Unix socket (usable with ``curl --unix-socket``).

Every error is a response ``{"error": code, "message": ..., "retryable": bool}`` with the error's
status; nothing answers with a traceback. A peer whose uid is not the daemon's gets 403 before
any handler runs. Expert bytes over HTTP are for tools and debugging: the engine's client uses
the fd data path (``datapath``), which copies nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from cachecd.daemon import metrics as prom
from cachecd.daemon.peer import peer_cred
from cachecd.daemon.removal import remove_model
from cachecd.errors import CachecdError, Forbidden, Internal, InvalidRequest, NotFound
from cachecd.report.coverage import (
    access_array,
    cached_mask,
    coverage_report,
    pack_detail,
    pinned_mask,
)

log = logging.getLogger(__name__)

DAEMON: web.AppKey[Any] = web.AppKey("daemon")
METRICS: web.AppKey[CollectorRegistry] = web.AppKey("metrics", CollectorRegistry)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(exc: CachecdError) -> web.Response:
    return web.json_response(exc.to_wire(), status=exc.http_status)


@web.middleware
async def peer_check(request: web.Request, handler: Handler) -> web.StreamResponse:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and sock.family == socket.AF_UNIX:
        cred = peer_cred(sock)
        if cred.uid != os.getuid():
            log.warning("peer refused uid=%d pid=%d path=%s", cred.uid, cred.pid, request.path)
            return error_response(Forbidden(f"uid {cred.uid} may not use this daemon"))
    return await handler(request)


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except CachecdError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        cls = NotFound if exc.status in (404, 405) else InvalidRequest
        err = cls(f"{request.method} {request.path}: {exc.reason}")
        return web.json_response(err.to_wire(), status=exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        log.exception("handler failed path=%s", request.path)
        return error_response(Internal(f"{type(exc).__name__}: {exc}"))


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def _repo(request: web.Request) -> str:
    return f"{request.match_info['org']}/{request.match_info['name']}"


def _int_param(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidRequest(f"{what} must be a whole number, got {text!r}") from None


def _ids(text: str) -> list[int]:
    if not text:
        raise InvalidRequest("ids= is required: a comma-separated list of expert numbers")
    return [_int_param(t, "expert") for t in text.split(",")]


async def healthz(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    starting = bool(d.registry.starting)  # answering, not yet serving every --manifest model
    return web.json_response({"ok": not d.draining and not starting, "starting": starting,
                              "pid": os.getpid(), "version": d.status()["version"]})


async def status(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    await d.misses.settled()  # what was handed out is in the store before it is reported
    info = d.status()
    verbose = request.query.get("verbose") == "1"
    await asyncio.to_thread(_add_coverage, d, info["models"], verbose)
    return web.json_response(info)


def _add_coverage(d: Any, models: list[dict[str, Any]], verbose: bool = False) -> None:
    """Each model's experts cached and pinned, of those the daemon serves (a thread: K3 has
    82,432); ``verbose``: the pinned ones' [layer, expert] too."""
    by_name = {(m.repo, m.manifest.revision): m for m in d.registry.all()}
    pins = d.store.pins()
    for row in models:
        model = by_name.get((row["repo"], row["revision"]))
        if model is None:
            continue
        m = model.manifest
        cached = cached_mask(m, d.store.has_source) & model.served_rows()
        row["experts_cached"] = int(cached.sum())
        row["expert_bytes_cached"] = int(m.sizes[cached].sum())
        pinned = pinned_mask(m, pins) & model.served_rows()
        row["experts_pinned"] = int(pinned.sum())
        row["expert_bytes_pinned"] = int(m.sizes[pinned].sum())
        if verbose:
            row["pinned"] = [[int(m.layer_ids[i]), int(m.expert_ids[i])]
                             for i in pinned.nonzero()[0]]


async def fetches(request: web.Request) -> web.Response:
    """The fetches under way and done (``MissFiller.fetching``): cheap, for a client that shows
    progress while a read waits (``cachecd_client.waits``); ``/v1/status`` says more."""
    return web.json_response(request.app[DAEMON].misses.fetching())


async def metrics(request: web.Request) -> web.Response:
    await request.app[DAEMON].misses.settled()  # as status: what was handed out is counted
    body = prom.render(request.app[METRICS])
    return web.Response(body=body, headers={"Content-Type": prom.CONTENT_TYPE})


async def list_models(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    return web.json_response({"models": [m.describe() for m in d.registry.all()],
                              "refused": dict(d.registry.refused)})


async def register_model(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    if request.content_type == "application/json":
        body = await _json_body(request)
        path = body.get("manifest")
        if not isinstance(path, str):
            raise InvalidRequest("POST /v1/models takes {\"manifest\": PATH, \"local_dir\": DIR, "
                                 "\"layers\": [START, END], \"pipeline\": [RANK, SIZE], "
                                 "\"names\": [REV, ...]}")
        try:
            data = await asyncio.to_thread(_read_file, path)
        except OSError as exc:
            raise InvalidRequest(f"cannot read manifest {path}: {exc.strerror}") from None
        source, local_dir = path, body.get("local_dir")
        layers, pipeline = body.get("layers"), body.get("pipeline")
        origin, endpoint, names = body.get("origin"), body.get("endpoint"), body.get("names")
        if origin is not None and (not isinstance(origin, str) or len(origin) > 1000):
            raise InvalidRequest("origin must be a string (where the manifest came from)")
        if endpoint is not None and (not isinstance(endpoint, str) or len(endpoint) > 2000):
            raise InvalidRequest("endpoint must be a string (the endpoint it was installed from)")
    else:
        data, source, local_dir = await request.read(), "<upload>", request.query.get("local_dir")
        layers = pipeline = origin = endpoint = names = None
    # Installed from where the caller says, else from where this daemon fetches.
    model = await d.registry.register(data, source, local_dir, layers, pipeline, origin,
                                      endpoint or d.settings.endpoint, names)
    return web.json_response(model.describe(), status=201)


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def unregister_model(request: web.Request) -> web.Response:
    """``cachecd remove``: unregister, delete the resident files; ``?experts=1`` evicts the
    model's cached experts too (those another registered model shares stay)."""
    d = request.app[DAEMON]
    repo = _repo(request)  # ORG/NAME[@REV]: the registry's parser checks it
    experts = request.query.get("experts") in ("1", "true")
    return web.json_response(await remove_model(d, repo, experts))


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[DAEMON].model(_repo(request)).describe())


async def model_manifest(request: web.Request) -> web.FileResponse:
    model = request.app[DAEMON].model(_repo(request))
    return web.FileResponse(model.manifest_path)


async def _stream_experts(request: web.Request, layer: int, ids: list[int]) -> web.StreamResponse:
    d = request.app[DAEMON]
    started = time.monotonic()
    opened = await d.open_experts(_repo(request), layer, ids)
    try:
        resp = web.StreamResponse(headers={
            "Content-Type": "application/octet-stream",
            "Content-Length": str(sum(o.size for o in opened)),
            "X-Expert-Sizes": ",".join(str(o.size) for o in opened),
            "X-Expert-Digests": ",".join(o.digest for o in opened),
        })
        await resp.prepare(request)
        for o in opened:
            offset = 0
            while offset < o.size:
                chunk = await asyncio.to_thread(os.pread, o.fd, min(4 << 20, o.size - offset), offset)
                if not chunk:
                    raise Internal(f"blob {o.digest} ended early at {offset} of {o.size}")
                await resp.write(chunk)
                offset += len(chunk)
        await resp.write_eof()
        d.latency.request(time.monotonic() - started, any(o.fetched for o in opened))
        return resp
    finally:
        for o in opened:
            os.close(o.fd)


async def expert_bytes(request: web.Request) -> web.StreamResponse:
    layer = _int_param(request.match_info["layer"], "layer")
    return await _stream_experts(request, layer, [_int_param(request.match_info["expert"], "expert")])


async def expert_batch(request: web.Request) -> web.StreamResponse:
    layer = _int_param(request.match_info["layer"], "layer")
    return await _stream_experts(request, layer, _ids(request.query.get("ids", "")))


async def prefetch(request: web.Request) -> web.Response:
    body = await _json_body(request)
    await request.app[DAEMON].serving(_repo(request))
    queued = request.app[DAEMON].prefetch(_repo(request), body.get("layer"), list(body.get("ids") or []))
    return web.json_response({"queued": queued}, status=202)


async def recheck(request: web.Request) -> web.Response:
    """A reader's report that experts' bytes failed their digest: the daemon hashes their blobs
    again and quarantines only those that fail here (``Daemon.recheck``)."""
    body = await _json_body(request)
    d = request.app[DAEMON]
    verdicts = await d.recheck(_repo(request), body.get("layer"), list(body.get("ids") or []))
    return web.json_response({"experts": verdicts})


async def digests(request: web.Request) -> web.Response:
    """``?layer=L&ids=1,2``: each expert's digest as the daemon verifies its blob, or null where
    it is not learnt yet (``Daemon.digests``)."""
    q = request.rel_url.query
    try:
        layer = int(q.get("layer", ""))
        ids = [int(i) for i in q.get("ids", "").split(",") if i]
    except ValueError:
        raise InvalidRequest("digests: ?layer=L&ids=1,2 with whole numbers") from None
    found = request.app[DAEMON].digests(_repo(request), layer, ids)
    return web.json_response({"digests": found})


async def coverage(request: web.Request) -> web.Response:
    """The coverage report; ``?detail=1`` adds the per-expert arrays (``coverage.pack_detail``)."""
    d = request.app[DAEMON]
    model = d.model(_repo(request))
    m = model.manifest
    detail = request.query.get("detail") in ("1", "true")
    await d.misses.settled()

    def build() -> dict[str, Any]:
        cached, access = cached_mask(m, d.store.has_source), access_array(m, d.store.access_counts(m.key))
        report = coverage_report(m, cached, access, layers=model.layers)
        report["pipeline"] = model.describe()["pipeline"]
        report["history"] = d.history.snapshot(m.key)
        if detail:
            report["detail"] = pack_detail(cached, access)
        return report

    return web.json_response(await asyncio.to_thread(build))


async def warm(request: web.Request) -> web.Response:
    """Fetch experts into the cache without counting them as used (warming is not workload)."""
    d = request.app[DAEMON]
    body = await _json_body(request)
    model = await d.serving(_repo(request))
    entries = d.entries(model, body.get("layer"), list(body.get("ids") or []))
    learnt = d.learner.unlearnt(model, entries)  # fetched (proven) now to learn their digests
    entries = await d.learner.entries(model, entries)
    missing = d.misses.missing(entries) + learnt
    await d.misses.ensure(model, d.misses.missing(entries))
    await d.misses.settled()
    d.counters["warm_fetched_experts"] += len(missing)
    return web.json_response({"requested": len(entries), "fetched": len(missing),
                              "fetched_bytes": sum(e.nbytes for e in missing)})


async def pin(request: web.Request) -> web.Response:
    return await _pin(request, True)


async def unpin(request: web.Request) -> web.Response:
    return await _pin(request, False)


async def _pin(request: web.Request, on: bool) -> web.Response:
    d = request.app[DAEMON]
    body = await _json_body(request)
    model = await d.serving(_repo(request)) if on else d.model(_repo(request))
    entries = d.entries(model, body.get("layer"), list(body.get("ids") or []))
    if on:
        entries = await d.learner.entries(model, entries)
        await d.ensure(model, entries)
        await d.misses.settled()
    for e in entries:
        await (d.store.pin(e.digest_hex) if on else d.store.unpin(e.digest_hex))
    return web.json_response({"pinned" if on else "unpinned": len(entries)})


async def evict(request: web.Request) -> web.Response:
    d = request.app[DAEMON]
    body = await _json_body(request)
    digests = None
    if "model" in body:
        model = d.model(str(body["model"]))
        entries = d.entries(model, body.get("layer"), list(body.get("ids") or []),
                            served_only=False)  # evicting fetches nothing
        digests = [e.digest_hex for e in entries]
    nbytes = body.get("bytes", 0)
    if not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidRequest("bytes must be a whole number >= 0")
    await d.misses.settled()
    freed = await d.store.evict(digests, nbytes)
    pinned = len(set(digests or ()) & d.store.pins())  # skipped: the caller is told why
    return web.json_response({"freed_bytes": freed, "pinned": pinned})


def build_app(daemon: Any, client_max_size: int, door: Any = None) -> web.Application:
    first = [door.middleware] if door is not None else []  # sees a request before any refusal
    app = web.Application(middlewares=[*first, errors_as_json, peer_check],
                          client_max_size=client_max_size)
    app[DAEMON] = daemon
    app[METRICS] = prom.registry_for(daemon)
    base = "/v1/models/{org}/{name}"
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/fetches", fetches)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/models", register_model)
    app.router.add_get(base, model_info)
    app.router.add_delete(base, unregister_model)
    app.router.add_get(base + "/manifest", model_manifest)
    app.router.add_get(base + "/experts/{layer}/{expert}", expert_bytes)
    app.router.add_get(base + "/experts/{layer}", expert_batch)
    app.router.add_post(base + "/prefetch", prefetch)
    app.router.add_post(base + "/recheck", recheck)
    app.router.add_get(base + "/digests", digests)
    app.router.add_get(base + "/coverage", coverage)
    app.router.add_post(base + "/warm", warm)
    app.router.add_post(base + "/pin", pin)
    app.router.add_post(base + "/unpin", unpin)
    app.router.add_post("/v1/evict", evict)
    return app
