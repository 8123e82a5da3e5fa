"""The daemon's state and the operations both front doors (HTTP control, fd data path) share.

Invariants:
- Every expert handed out was verified against its manifest before it entered the store; a hit
  is served from the store only, and a miss goes through the single-flight filler. A blob is a
  hit for an expert only if it was verified as that expert's own ranges (its source key,
  ``store.sources``); one cached under the same digest for other bytes is a miss, fetched from
  the expert's ranges and verified, then gains that source (``MissFiller.missing``). A blob this
  daemon did not commit itself is hashed on its first open, and any blob again at an open a day
  (``constants.REVERIFY_AFTER_S``) after its last hash (``Store.verify_open_blob``).
- A hit reuses an fd the daemon already holds for that blob (``BlobFds``) only while the store
  still indexes the very same row and the file is still linked with the row's size; otherwise
  the blob is opened through ``Store.open_blob``, which drops or quarantines a bad one. An expert
  verified moments ago whose commit is still under way is served from its temp file (``MissFiller``'s
  ``fresh``). Every fd
  handed out is the caller's own (a dup), so an eviction never cuts off a read in progress.
- A blob the background scrub (``store.scrub``) or an open quarantined is never handed out
  afterwards: the fd cache checks the row on every hit, and a request that opened a blob before
  its quarantine landed opens its experts again before it answers.
- Access stats are recorded once per distinct expert per request.
- A model installed from another endpoint than the daemon's gets no miss fetched (409
  ``endpoint_mismatch``, prefetch hints dropped) unless ``allow_other_endpoint``; its hits are
  served.
- ``reservations_full`` says "Retry shortly" only where waiting can help (others' fetches and
  requests hold the room); where pins take it, it names unpin; a request whose own experts
  exceed the whole budget gets ``budget_too_small`` (not retryable) naming the budget that
  would serve it and ``--prefill-step-size``.
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
from cachecd.config import Settings, settings_summary
from cachecd.daemon.learn import Learner
from cachecd.daemon.metrics import Latencies
from cachecd.daemon.misses import MissFiller, flight_key
from cachecd.daemon.registry import RegisteredModel, Registry
from cachecd.errors import (
    BudgetTooSmall,
    EndpointMismatch,
    ExpertNotFound,
    InvalidRequest,
    ReservationsFull,
)
from cachecd.manifest.headers import keep_dir
from cachecd.report.coverage import HitHistory
from cachecd.store.blob_fds import BlobFds
from cachecd.store.scrub import Scrubber
from cachecd.store.store import Store

if TYPE_CHECKING:
    from cachecd.manifest.entries import ExpertEntry
    from cachecd.upstream.fetch import Upstream

log = logging.getLogger(__name__)


@dataclass
class OpenedExpert:
    expert: int
    fd: int
    size: int
    digest: str
    fetched: bool = False  # this request waited for an upstream fetch of it


# What a request used, to record once it is answered: (model key, distinct experts).
Uses = tuple[str, list["ExpertEntry"]]


def _int(value: Any, what: str, limit: int = 1 << 20) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise InvalidRequest(f"{what} must be a whole number in [0, {limit}), got {value!r}")
    return value


class Daemon:
    def __init__(self, settings: Settings, store: Store, upstream: Upstream) -> None:
        self.settings = settings
        self.store = store
        self.upstream = upstream
        # The checks on use are the source's: what it holds at the commit, and the layout.
        checks = upstream.source.use_checks(keep_dir(settings.models_dir), settings.total_timeout)
        self.registry = Registry(store, settings.models_dir, checks.metadata, checks.layout)
        self.misses = MissFiller(store, upstream)
        self.learner = Learner(store, upstream)  # digests of a manifest made from headers
        self.latency = Latencies()
        upstream.observe_requests(self.latency.upstream_request)
        self.counters: Counter[str] = Counter()
        self.history = HitHistory()
        self.started = time.time()
        self.max_connections = constants.MAX_CONNECTIONS
        self.blob_fds = BlobFds(store)
        self.draining = False
        self.sharing: Any = None  # serve.py's share.Sharing under --share
        # Demand fetches first: the scrub slows down while any is in flight (read from its thread).
        self.scrub = Scrubber(store, settings.scrub_rate, busy=lambda: self.misses.inflight > 0)

    def model(self, repo: str) -> RegisteredModel:
        return self.registry.get(repo)

    async def serving(self, repo: str) -> RegisteredModel:
        """``model``, once its layout is checked: no expert of a model flows, hit or miss, before
        its manifest's ranges agree with the shards' headers (``Registry.check_layout``)."""
        model = self.registry.get(repo)
        if not model.layout_checked:
            await self.registry.check_layout(model)
        return model

    def entries(self, model: RegisteredModel, layer: Any, ids: list[Any], *,
                served_only: bool = True) -> list[ExpertEntry]:
        """Manifest entries of ``ids`` in ``layer``; a layer the registration does not serve is
        refused (``layer_not_served``) unless ``served_only`` is off (eviction: nothing fetched)."""
        layer = _int(layer, "layer")
        if served_only:
            model.check_layer(layer)
        if len(ids) > constants.MAX_BATCH_EXPERTS:
            raise InvalidRequest(f"at most {constants.MAX_BATCH_EXPERTS} experts per request")
        return [model.manifest.expert(layer, _int(e, "expert")) for e in ids]

    async def ensure(self, model: RegisteredModel, entries: list[ExpertEntry], *,
                     warm: bool = False) -> set[str]:
        """Make every entry local; returns the digests that were missing (fetched for this call).
        ``warm``: the caller is warming the cache, so it counts as warm fetches, not as use."""
        # One count per distinct expert per request, whatever the caller repeats.
        distinct = list({(e.layer, e.expert): e for e in entries}.values())
        need = self.misses.missing(distinct)
        # An expert verified moments ago and still being committed is local: a hit that waits.
        missing = {e.digest_hex for e in need if not self.misses.committing(flight_key(e))}
        if warm:
            self.counters["warm_fetched_experts"] += len(missing)
        else:
            self.counters["expert_requests"] += len(distinct)
            self.counters["expert_misses"] += len(missing)
            self.counters["expert_hits"] += len(distinct) - len(missing)
            self.history.record(model.manifest.key, len(distinct) - len(missing), len(missing))
        if need:  # all hits: nothing can have changed since the look-up above (no await)
            self.check_endpoint(model)
            try:
                await self.misses.fill(model, need)
            except ReservationsFull as exc:
                raise self._budget_error(model, distinct, exc) from None
        return missing

    def check_endpoint(self, model: RegisteredModel) -> None:
        """Refuse to fetch a model's experts from another endpoint than it was installed from,
        unless told (``--allow-other-endpoint``)."""
        here = self.settings.endpoint
        if model.other_endpoint(here) and not self.settings.allow_other_endpoint:
            raise EndpointMismatch(
                f"{model.name} was installed from {model.endpoint}, and this daemon fetches from "
                f"{here}: its experts that are not cached are not fetched from {here} unless you "
                f"say so: restart the daemon with --endpoint {model.endpoint} (cachecd stop; "
                f"cachecd serve --endpoint {model.endpoint}), or re-run `cachecd setup --stream "
                f"{model.name} --endpoint {here}` to install it from {here}, or start the daemon "
                "with --allow-other-endpoint (its bytes are verified against its manifest either "
                "way)")

    def _budget_error(self, model: RegisteredModel, entries: list[ExpertEntry],
                      exc: ReservationsFull) -> ReservationsFull:
        """``exc`` as it is, where waiting can help (others' fetches and requests hold the room);
        else what to do: unpin (the pins take the room) or ``BudgetTooSmall`` (this request's
        experts alone exceed the budget)."""
        from cachecd.manifest.step_need import request_too_big

        stats = self.store.stats()
        limit, pinned = stats.get("budget", 0), stats.get("pinned_bytes", 0)
        need = sum(e.nbytes for e in entries)
        if not limit or need + pinned <= limit:
            return exc
        if need <= limit:  # the pins take the room: unpinning helps, waiting does not
            return ReservationsFull(
                f"{model.name}: this request needs {need} bytes of experts on disk at once, and "
                f"{pinned} of the budget's {limit} bytes are pinned: unpin some (cachecd unpin) "
                "or raise --budget, then ask again")
        return BudgetTooSmall(request_too_big(model.name, len(entries), entries[0].layer, need,
                                              limit))

    async def open_experts(self, repo: str, layer: Any, ids: list[Any]) -> list[OpenedExpert]:
        """One opened blob per id, in order, uses recorded; the caller closes every fd."""
        opened, uses = await self.open_unrecorded(repo, layer, ids)
        self.record_uses(uses)
        return opened

    async def open_unrecorded(self, repo: str, layer: Any, ids: list[Any], *,
                              warm: bool = False) -> tuple[list[OpenedExpert], Uses]:
        """``open_experts`` without recording the uses: the caller passes them to
        ``record_uses`` exactly once, after answering, so that bookkeeping overlaps the client's
        reads instead of delaying them. ``warm``: the reads warm the cache (``cachecd warm
        --prompts``): no use to record (the uses returned are empty), no hit or miss counted."""
        model = self.model(repo)
        if not model.layout_checked:
            model = await self.serving(repo)
        entries = await self.learner.entries(model, self.entries(model, layer, ids))
        digests = [e.digest_hex for e in entries]
        # Spared from eviction until opened: under a tight budget the other requests' fetches
        # would otherwise evict what this one fetched, or found, before it opens them.
        self.store.hold(digests)
        try:
            missing = await self.ensure(model, entries, warm=warm)
            for _ in range(3):
                seq = self.store.quarantine_seq
                opened = await self._open_all(model, entries, missing)
                # A blob quarantined while this request held its fd (the scrub runs on its own
                # thread): open again, so nothing is answered from it after the verdict.
                if seq == self.store.quarantine_seq or not self.store.quarantined_since(seq, digests):
                    # One use per distinct expert per request, whatever the caller repeats.
                    used = [] if warm else list({e.expert: e for e in entries}.values())
                    return opened, (model.manifest.key, used)
                for o in opened:
                    os.close(o.fd)
        finally:
            self.store.release_hold(digests)
        raise ExpertNotFound(f"layer {entries[0].layer}: experts were quarantined three times while "
                             "being opened; check the disk (`cachecd status`)")

    async def _open_all(self, model: RegisteredModel, entries: list[ExpertEntry],
                        missing: set[str]) -> list[OpenedExpert]:
        self.blob_fds.check()
        opened: list[OpenedExpert] = []
        try:
            to_hash = {e.digest_hex: e for e in entries if self._needs_hash(e)}
            if len(to_hash) > 1:
                await self._open_to_hash(model, to_hash)  # the hashes run side by side
            for entry in entries:
                digest = entry.digest_hex
                # ``ensure`` made each entry's own source a hit (or verified it just now), so
                # any fd of its digest holds its bytes.
                got = (self.blob_fds.take(digest) or self.misses.take_fresh(entry)
                       or await self._open_blob(model, entry, digest))
                opened.append(OpenedExpert(entry.expert, got[0], got[1], digest, digest in missing))
        except BaseException:
            for o in opened:
                os.close(o.fd)
            raise
        return opened

    def record_uses(self, uses: Uses) -> None:
        key, entries = uses
        for e in entries:
            # A use of a blob still being committed reaches the policy once the blob is in.
            later = self.misses.touch_after_commit(e)
            self.store.touch(e.digest_hex, key, e.layer, e.expert, policy=not later)

    def _needs_hash(self, entry: ExpertEntry) -> bool:
        """Whether serving ``entry`` now would go through ``_open_blob`` and hash it."""
        # Cheapest first: a warm hit's digest is in blob_fds, and this runs for every request.
        digest = entry.digest_hex
        return (digest not in self.blob_fds and not self.misses.committing(flight_key(entry))
                and self.store.unverified(digest))

    async def _open_to_hash(self, model: RegisteredModel, todo: dict[str, ExpertEntry]) -> None:
        """Open (and so hash) these blobs at once, one task each, into ``blob_fds``, where the
        request's loop then finds them. After a restart every blob is unverified, and hashing
        them one after another would use one core."""
        tasks = [asyncio.ensure_future(self._open_blob(model, e, d)) for d, e in todo.items()]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()  # it closes its own fd when the cancel lands
                    t.add_done_callback(_retrieve)  # a second failure is not an unread error
                elif not t.cancelled() and t.exception() is None:
                    os.close(t.result()[0])  # blob_fds kept a dup

    async def open_verified_blob(self, digest: str) -> tuple[int, int]:
        """A cached blob's fd and size, the blob hashed first where this process has not hashed
        it (one from an earlier run); ``ExpertNotFound`` where it is gone or rotten. Hits and
        the share (``share.Sharing``) open blobs through this."""
        fd, size = self.store.open_blob(digest)
        if self.store.unverified(digest):
            try:
                # The thread hashes its own dup: if this task is cancelled and closes ``fd``,
                # the hash still reads the blob, never whatever reuses the fd number.
                await asyncio.to_thread(self.store.verify_open_blob, digest, os.dup(fd))
            except BaseException:
                os.close(fd)
                raise
        return fd, size

    async def _open_blob(self, model: RegisteredModel, entry: ExpertEntry,
                         digest: str) -> tuple[int, int]:
        for _ in range(3):  # evicted between ensure and open, or rotten: fetch again
            try:
                fd, size = await self.open_verified_blob(digest)
            except ExpertNotFound:
                await self.misses.ensure(model, [entry])
                continue
            self.blob_fds.keep(digest, fd, size)
            return fd, size
        raise ExpertNotFound(f"layer {entry.layer} expert {entry.expert} vanished from the cache three "
                             "times while being opened; the budget may be too small for one batch")

    async def recheck(self, repo: str, layer: Any, ids: list[Any]) -> list[dict[str, Any]]:
        """A reader found these experts' bytes wrong as it read them: each distinct blob is
        hashed again here, side by side on threads (``Store.recheck``), and only one that
        fails goes to quarantine/, so the reader's next request fetches it again."""
        entries = self.entries(self.model(repo), layer, ids, served_only=False)
        digests = list(dict.fromkeys(e.digest_hex for e in entries))
        verdicts = await asyncio.gather(*(asyncio.to_thread(self.store.recheck, d)
                                          for d in digests))
        found = dict(zip(digests, verdicts, strict=True))
        return [{"expert": e.expert, "verdict": found[e.digest_hex]} for e in entries]

    def digests(self, repo: str, layer: Any, ids: list[Any]) -> list[str | None]:
        """The xxh3-128 (hex) these experts' blobs are verified as: the manifest's, or for a
        model whose manifest was made from headers the one learnt from its proven bytes; None
        for one not learnt yet (a reader checks that one's bytes once it is)."""
        m = self.model(repo).manifest
        return [None if m.unlearnt(m.row(e.layer, e.expert)) else e.digest_hex
                for e in self.entries(self.model(repo), layer, ids, served_only=False)]

    def prefetch(self, repo: str, layer: Any, ids: list[Any]) -> int:
        model = self.model(repo)
        if model.other_endpoint(self.settings.endpoint) and not self.settings.allow_other_endpoint:
            return 0  # a hint is no word to fetch from elsewhere; a demand says why not
        entries = self.entries(model, layer, ids)
        unlearnt = self.learner.unlearnt(model, entries)
        if unlearnt:  # no digest to fetch by yet: learnt (fetched, proven) in the background
            return self.learner.prefetch(model, unlearnt)
        return self.misses.prefetch(model, entries)

    def status(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "version": constants.VERSION,
            "uptime_s": round(time.time() - self.started, 3),
            "socket": str(self.settings.socket),
            "cache_dirs": [str(d) for d in self.settings.cache_dirs],
            "models_dir": str(self.settings.models_dir),
            "endpoint": self.settings.endpoint,
            "offline": self.settings.offline,
            "settings": settings_summary(self.settings),
            "store": self.store.stats(),
            "inflight": self.misses.inflight,
            "counters": dict(self.counters) | dict(self.misses.counters)
            | dict(self.learner.counters),
            "upstream": self.upstream.stats(),
            "share": self.sharing.status() if self.sharing is not None else None,
            "peers": self.upstream.peers.describe() if self.upstream.peers is not None else [],
            "models": [self._describe(m) for m in self.registry.all()],
            "refused_models": dict(self.registry.refused),
            "starting": sorted(self.registry.starting),  # --manifest paths not registered yet
            "scrub": self.scrub.status(),
            "debug": {**_process_counts(), "blob_fds": len(self.blob_fds)},
        }

    def _describe(self, model: RegisteredModel) -> dict[str, Any]:
        """A model for status, with the route its files are read by where the source has
        several (``xet_source.routes``): None until one was read since the daemon started."""
        routes = getattr(self.upstream.source, "routes", None)
        if routes is None:  # a source with one route (a local folder)
            return model.describe()
        return model.describe() | {"route": routes().get(f"{model.repo}@{model.manifest.revision}")}


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


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
