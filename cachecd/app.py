"""The daemon's state and the operations both front doors (HTTP control, fd data path) share.

Invariant: every expert handed out was verified against its manifest before it entered the
store; a hit is served from the store only, and a miss goes through the single-flight fetcher.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachecd import constants
from cachecd.config import Settings
from cachecd.coverage import HitHistory
from cachecd.errors import ExpertNotFound, InvalidRequest
from cachecd.misses import Fetcher
from cachecd.registry import Registry, RegisteredModel, check_repo
from cachecd.store import Store

if TYPE_CHECKING:
    from cachecd.hub import Upstream
    from cachecd.manifest import ExpertEntry

log = logging.getLogger(__name__)


@dataclass
class OpenedExpert:
    expert: int
    fd: int
    size: int
    digest: str
    fetched: bool = False  # this request waited for an upstream fetch of it


def parse_repo(repo: str) -> str:
    org, sep, name = repo.partition("/")
    if not sep:
        raise InvalidRequest(f"model {repo!r} must be ORG/NAME")
    return check_repo(org, name)


def _int(value: Any, what: str, limit: int = 1 << 20) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise InvalidRequest(f"{what} must be a whole number in [0, {limit}), got {value!r}")
    return value


class Daemon:
    def __init__(self, settings: Settings, store: Store, upstream: "Upstream") -> None:
        self.settings = settings
        self.store = store
        self.upstream = upstream
        self.registry = Registry(store, settings.models_dir)
        self.fetcher = Fetcher(store, upstream)
        self.counters: Counter[str] = Counter()
        self.history = HitHistory()
        self.started = time.time()
        self.max_connections = constants.MAX_CONNECTIONS
        self.draining = False

    def model(self, repo: str) -> RegisteredModel:
        return self.registry.get(parse_repo(repo))

    def entries(self, model: RegisteredModel, layer: Any, ids: list[Any]) -> list["ExpertEntry"]:
        layer = _int(layer, "layer")
        if len(ids) > constants.MAX_BATCH_EXPERTS:
            raise InvalidRequest(f"at most {constants.MAX_BATCH_EXPERTS} experts per request")
        return [model.manifest.expert(layer, _int(e, "expert")) for e in ids]

    async def ensure(self, model: RegisteredModel, entries: list["ExpertEntry"]) -> set[str]:
        """Make every entry local; returns the digests that were missing (fetched for this call)."""
        # One count per distinct expert per request, whatever the caller repeats.
        distinct = list({(e.layer, e.expert): e for e in entries}.values())
        missing = {e.digest_hex for e in self.fetcher.missing(distinct)}
        self.counters["expert_requests"] += len(distinct)
        self.counters["expert_misses"] += len(missing)
        self.counters["expert_hits"] += len(distinct) - len(missing)
        self.history.record(model.manifest.key, len(distinct) - len(missing), len(missing))
        await self.fetcher.ensure(model, entries)
        return missing

    async def open_experts(self, repo: str, layer: Any, ids: list[Any]) -> list[OpenedExpert]:
        model = self.model(repo)
        entries = self.entries(model, layer, ids)
        missing = await self.ensure(model, entries)
        opened: list[OpenedExpert] = []
        counted: set[int] = set()
        try:
            for entry in entries:
                one = await self._open_one(model, entry, entry.expert not in counted)
                one.fetched = entry.digest_hex in missing
                opened.append(one)
                counted.add(entry.expert)
        except BaseException:
            for o in opened:
                os.close(o.fd)
            raise
        return opened

    async def _open_one(self, model: RegisteredModel, entry: "ExpertEntry",
                        count: bool = True) -> OpenedExpert:
        for _ in range(3):  # evicted between ensure and open: fetch again
            try:
                fd, size = self.store.open_blob(entry.digest_hex)
            except ExpertNotFound:
                await self.fetcher.ensure(model, [entry])
                continue
            if count:
                self.store.touch(entry.digest_hex, model.manifest.key, entry.layer, entry.expert)
            return OpenedExpert(entry.expert, fd, size, entry.digest_hex)
        raise ExpertNotFound(f"layer {entry.layer} expert {entry.expert} vanished from the cache three "
                             "times while being opened; the budget may be too small for one batch")

    def prefetch(self, repo: str, layer: Any, ids: list[Any]) -> int:
        model = self.model(repo)
        return self.fetcher.prefetch(model, self.entries(model, layer, ids))

    def status(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "version": constants.VERSION,
            "uptime_s": round(time.time() - self.started, 3),
            "socket": str(self.settings.socket),
            "cache_dirs": [str(d) for d in self.settings.cache_dirs],
            "endpoint": self.settings.endpoint,
            "offline": self.settings.offline,
            "store": self.store.stats(),
            "inflight": self.fetcher.inflight,
            "counters": dict(self.counters) | dict(self.fetcher.counters),
            "upstream": self.upstream.stats(),
            "models": [m.describe() for m in self.registry.all()],
            "refused_models": dict(self.registry.refused),
            "debug": _process_counts(),
        }


def _process_counts() -> dict[str, int]:
    """Open fds and live asyncio tasks: the fault suite checks both return to their baseline."""
    try:
        fds = len(os.listdir("/proc/self/fd")) - 1  # minus the fd listdir itself holds
    except OSError:  # no procfs (macOS)
        fds = -1
    try:
        tasks = len(asyncio.all_tasks())
    except RuntimeError:  # called outside the event loop
        tasks = -1
    return {"open_fds": fds, "tasks": tasks}
