"""Digests learnt from proven bytes: the experts of a model registered with a manifest made from its
headers (``setup --stream`` with no manifest, ``Manifest.learns``).

Such a manifest knows every expert's ranges and no expert's digest. The first request for one
fetches its ranges through the upstream, which hands on only bytes proven through Xet against the
Hub's hash of the shard at the pinned commit (``xet_source``; a file outside Xet is refused here:
nothing would vouch for its bytes). Their xxh3-128 is then the expert's digest: the blob is
committed under it with the expert's source key, the digest recorded durably (one line per
expert, appended and synced, in ``<the daemon's manifest copy>.learnt``) and set in the manifest,
so from then on the expert is an ordinary entry: a hit, a miss fetched and verified against it,
scrubbed, shared.

Invariants: one fetch per expert however many ask (``SingleFlight``); no digest is learnt from
bytes that did not come proven; a record line names the expert's source key, and a line whose key
is not the manifest's (another manifest of that commit registered since) is ignored on load.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from cachecd.durable import full_fsync
from cachecd.errors import CachecdError, XetProofError
from cachecd.store.sources import ORIGIN_SOURCE
from cachecd.upstream.singleflight import SingleFlight

if TYPE_CHECKING:
    from cachecd.manifest.entries import ByteRange, ExpertEntry
    from cachecd.store.store import Store
    from cachecd.upstream.fetch import Upstream

log = logging.getLogger(__name__)

Model = Any  # a ``registry.RegisteredModel`` (which loads this module: no import back)

SPAN_GAP = 512 << 10
SPAN_MAX = 64 << 20


def record_path(manifest_path: Path) -> Path:
    return manifest_path.with_name(manifest_path.name + ".learnt")


def load(model: Model) -> int:
    """Set the digests recorded for ``model`` in its manifest; returns how many."""
    m = model.manifest
    if not m.learns:
        return 0
    try:
        lines = record_path(model.manifest_path).read_text().splitlines()
    except OSError:
        return 0
    n = 0
    for line in lines:
        parts = line.split()
        if len(parts) != 4:
            continue  # a line torn by a crash: that expert is learnt again
        try:
            row = m.row(int(parts[0]), int(parts[1]))
            digest = bytes.fromhex(parts[3])
        except (ValueError, CachecdError):  # a line this manifest cannot place: skipped
            continue
        if len(digest) == 16 and m.source_keys()[row] == parts[2]:
            m.learn(row, digest)
            n += 1
    return n


class Learner:
    """Learns the digests of a learning manifest's experts from their proven bytes."""

    def __init__(self, store: Store, upstream: Upstream) -> None:
        self._store, self._upstream = store, upstream
        self._flights: SingleFlight[tuple[str, int], None] = SingleFlight()
        self._tasks: set[asyncio.Task[None]] = set()
        self.counters: Counter[str] = Counter()

    async def entries(self, model: Model,
                      entries: list[ExpertEntry]) -> list[ExpertEntry]:
        """``entries`` with every digest known, learning those that are not (the caller's
        entries, as they are, for a manifest whose digests are its maker's). The first error
        of an expert that could not be learnt is raised."""
        m = model.manifest
        if not m.learns:
            return entries
        todo = {(m.key, m.row(e.layer, e.expert)): e for e in entries
                if m.unlearnt(m.row(e.layer, e.expert))}
        if todo:
            done = await self._flights.do_many(
                todo, lambda keys: self._learn_group(model, [todo[k] for k in keys]))
            for outcome in done.values():
                if isinstance(outcome, BaseException):
                    raise outcome
        return [m.expert(e.layer, e.expert) for e in entries]

    def unlearnt(self, model: Model, entries: list[ExpertEntry]) -> list[ExpertEntry]:
        m = model.manifest
        return [e for e in entries if m.unlearnt(m.row(e.layer, e.expert))]

    def prefetch(self, model: Model, entries: list[ExpertEntry]) -> int:
        """Learn these in the background (a hint: its failures are only logged)."""
        if not entries:
            return 0
        task = asyncio.get_running_loop().create_task(self._quietly(model, entries))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return len(entries)

    async def _quietly(self, model: Model, entries: list[ExpertEntry]) -> None:
        try:
            await self.entries(model, entries)
        except Exception as exc:  # a hint; the demand that follows says what failed
            log.info("event=learn_hint_failed repo=%s err=%r", model.manifest.repo, exc)

    async def _learn_group(self, model: Model, entries: list[ExpertEntry]
                           ) -> dict[tuple[str, int], BaseException | None]:
        """Fetch ``entries`` by as few ranges as their gaps allow (one proof window each: two
        windows over neighbouring experts would read the chunks between them twice), then
        learn each one's digest and commit its blob."""
        m = model.manifest
        wanted = spans([r for e in entries for r in e.ranges])
        self.counters["learn_groups"] += 1
        self.counters["learn_spans"] += len(wanted)
        got = await asyncio.gather(*(self._upstream.fetch_range(m, f, a, b) for f, a, b in wanted))
        proven = getattr(self._upstream.source, "proven", None)
        if proven is None or not all(proven(m, f) for f, _, _ in wanted):
            raise XetProofError(
                f"{m.key}: its shards are not served through Xet, so its experts' bytes cannot "
                "be proven, and it has no digest to verify them by; install it with a manifest "
                f"(cachecd setup --stream {m.key} --build-manifest)")
        out: dict[tuple[str, int], BaseException | None] = {}
        for entry in entries:
            key = (m.key, m.row(entry.layer, entry.expert))
            try:
                await self._learn(model, entry, _cut(entry, wanted, got))
                out[key] = None
            except Exception as exc:  # that expert fails; the others are learnt
                out[key] = exc
        return out

    async def _learn(self, model: Model, entry: ExpertEntry, data: bytes) -> None:
        m = model.manifest
        digest = await asyncio.to_thread(xxhash.xxh3_128_digest, data)
        reservation = await self._store.reserve(entry.nbytes)
        try:
            await self._store.commit(digest.hex(), memoryview(data), reservation, None,
                                     entry.source, ORIGIN_SOURCE)
        finally:
            reservation.release()
        row = m.row(entry.layer, entry.expert)
        line = f"{entry.layer} {entry.expert} {entry.source} {digest.hex()}\n"
        await asyncio.to_thread(_append, record_path(model.manifest_path), line)
        m.learn(row, digest)
        self.counters["learnt_experts"] += 1
        self.counters["learnt_bytes"] += entry.nbytes
        log.info("event=learnt repo=%s layer=%d expert=%d digest=%s", m.repo, entry.layer,
                 entry.expert, digest.hex())


Span = tuple[str, int, int]


def spans(ranges: list[ByteRange], gap: int = SPAN_GAP, most: int = SPAN_MAX) -> list[Span]:
    """The ranges merged per file where the gap between them is at most ``gap`` (a proof's
    window widens a range by about that much anyway) and the span stays within ``most``."""
    out: list[Span] = []
    for r in sorted(ranges, key=lambda r: (r.file, r.start)):
        if out:
            f, a, b = out[-1]
            if f == r.file and r.start - b <= gap and max(b, r.end) - a <= most:
                out[-1] = (f, a, max(b, r.end))
                continue
        out.append((r.file, r.start, r.end))
    return out


def _cut(entry: ExpertEntry, wanted: list[Span], got: list[bytearray]) -> bytes:
    parts = []
    for r in entry.ranges:
        i = next(i for i, (f, a, b) in enumerate(wanted) if f == r.file and a <= r.start
                 and r.end <= b)
        a = wanted[i][1]
        parts.append(bytes(memoryview(got[i])[r.start - a : r.end - a]))
    return b"".join(parts)


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line.encode())
        full_fsync(fd)
    finally:
        os.close(fd)
