"""Expert bytes into slots of the pool: now (a call's misses), or ahead (a guess) on threads.

Invariants:
- A slot is written only after ``SlotTable.claim`` gave it for this expert, and only while no
  queued work reads it: a claim takes a fenced slot only after evaluating its readers, and
  read-ahead never takes one.
- Claim, read, derive, ready: one transaction. A slot claimed for a miss is marked filled only
  once its bytes and derived arrays are in place; any exception before that (a read, the wait
  for a slot's queued readers or for read-ahead, a derive, an allocation failure or Ctrl-C
  anywhere between) frees every slot the call claimed before it leaves ``acquire``: outside
  ``acquire`` and ``stage``, every filling slot is a read-ahead or a deferred read under way.
  A read-ahead slot whose derive fails is freed too; a failed read-ahead of a routed expert is
  read again on demand. A freed slot keeps its fence (``slots``): its queued readers are evaluated before it
  is written again.
- The queued readers of the slots a claim takes are evaluated before any is written, and their
  fences are cleared only after that evaluation has returned.
- Read-ahead threads only write slots claimed for them; the table and the stats are touched
  by the model's thread alone (``sweep``/``finish`` take finished reads in).
- A deferred demand read (``acquire(defer=True)``: the bank's decode calls with the option on)
  runs on the filler's own thread while the model's thread builds the graph after the call; its
  slots stay claimed (filling) until ``complete`` has waited for the read and its copies, and
  ``complete`` runs before anything that evaluates or claims (the next layer call, a read-back
  of fences, ``settle``, a speculative step, ``close``). The caller queues nothing that reads
  those slots before then. A deferred read that fails frees its slots in ``complete`` once no
  read writes them any more.
- On a discrete CUDA GPU a demand read goes through pinned staging memory and the copy engine
  (``cuda_memory.Copier``), each window's copy started as soon as its read lands, so copies
  overlap the reads after them; a read-ahead through its reader thread's own staging and copy
  stream, its copies done before the read counts as landed.
- Every expert read, demand or read-ahead, is checked against its xxh3-128 by the source on its
  reader threads (``DaemonSource.verify``) before the read returns, so before its slot is
  marked filled: a slot never holds bytes other than its expert's. A failed check is read
  again into the same slot (the daemon quarantines a rotten blob and fetches it again); a read
  that still fails raises, and the slot is freed as for any failed read. Hits are not hashed:
  their bytes were checked when they came in.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import mlx.core as mx
import numpy as np

from cachecd import errors
from cachecd_engine.formats import Piece
from cachecd_engine.pool.arrays import PoolMemory
from cachecd_engine.pool.cuda_memory import Copier
from cachecd_engine.pool.slots import Key

# The bank is passed in as ``Any``: it imports this module, so this one may not import it back.
ExpertBank = Any

STAGING_BYTES = 512 << 20  # pinned staging for misses on CUDA: a batch of reads at most


class Filler:
    """Gets experts into the bank's slots; see the module docstring."""

    def __init__(self, bank: ExpertBank, readers: int = 2) -> None:
        self.bank = bank
        self._reads: dict[int, tuple[Key, Future[int]]] = {}  # slot -> read-ahead under way
        self._underived: list[int] = []  # slots filled by read-ahead, derived arrays not yet
        self.guessed: set[Key] = set()  # experts read ahead and not used yet
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="cachecd-ahead")
        self._local = threading.local()  # a reader thread's own copier (CUDA)
        self._ahead_copiers: list[Copier] = []
        self._lock = threading.Lock()
        self._demand = ThreadPoolExecutor(1, thread_name_prefix="cachecd-demand")
        # A deferred demand read under way: its layer, expert -> slot, the read.
        self._pending: tuple[int, dict[int, int], Future[int]] | None = None
        # On a discrete CUDA GPU misses go through pinned memory and the copy engine.
        self.copier = Copier() if bank.backend == "cuda" else None

    def acquire(self, layer: int, ids: list[int], defer: bool = False) -> dict[int, int]:
        """Every expert of ``ids`` in a slot, bytes in place: expert -> slot. Experts not held
        are read now into free slots or the policy's victims (never one of ``ids``'). With
        ``defer`` (formats that derive nothing from the bytes) the misses are read on the
        filler's thread and are in place only once ``complete`` returns."""
        self.complete()
        t0 = time.perf_counter()
        memory, table = self.bank.pool(layer, ids[0])
        stats = self.bank.stats
        plan0, readers0 = stats.plan_s, stats.readers_s  # counted where they happen, below
        self.sweep()
        t1 = time.perf_counter()
        held = table.use(layer, ids)
        stats.plan_s += time.perf_counter() - t1
        again = [e for e, slot in held.items() if slot in self._reads
                 and not self.finish(slot)]  # read-ahead that failed: read it now
        for e in again:
            del held[e]
        staged = self.guessed.intersection((layer, e) for e in held) if self.guessed else set()
        self.guessed.difference_update(staged)
        try:
            claimed = self._claim(layer, [e for e in ids if e not in held], set(held.values()))
            deferred = bool(defer and claimed and not memory.derived and not self._underived)
            if deferred:  # filled by ``complete``
                self._defer(layer, claimed)
            else:
                self._read_now(layer, claimed)
                self.derive_staged()
                stats.copied_bytes += memory.derive(list(claimed.values()))
        except BaseException:
            self._undo()
            raise
        t1 = time.perf_counter()
        if not deferred:
            table.filled(claimed.values())  # the commit: bytes and derived arrays in place
        stats.ram_hits += len(held) - len(staged)
        stats.staged_hits += len(staged)
        t2 = time.perf_counter()
        stats.plan_s += t2 - t1
        # Expert wait: reads, read-ahead a call needs, derived arrays; not the table's and the
        # policy's host work (plan_s) nor earlier calls' compute evaluated here (readers_s).
        stats.wait_s += (t2 - t0) - (stats.plan_s - plan0) - (stats.readers_s - readers0)
        return {**held, **claimed}

    def _claim(self, layer: int, ids: list[int], keep: set[int]) -> dict[int, int]:
        """Slots for ``ids``: free or idle ones first, then ones queued work reads (that work
        is evaluated first), then ones read-ahead is filling (after those reads land)."""
        table = self.bank.table
        assert table is not None
        if not ids:  # every expert held: nothing to claim
            return {}
        t0 = time.perf_counter()
        slots = table.claim(layer, ids, keep, take_fenced=False, use=True).slots
        self.bank.stats.plan_s += time.perf_counter() - t0
        rest = [e for e in ids if e not in slots]
        if rest:
            slots.update(self._claim_fenced(layer, rest, keep))
            rest = [e for e in rest if e not in slots]
        if rest:  # every other slot is being filled by read-ahead: let it land
            self.finish_all()
            slots.update(self._claim_fenced(layer, rest, keep))
        if len(slots) < len(ids):
            raise errors.InvalidRequest(
                f"{len(ids)} experts do not fit a pool of {table.capacity} slots")
        return slots

    def _claim_fenced(self, layer: int, ids: list[int], keep: set[int]) -> dict[int, int]:
        """Slots for ``ids`` that queued work may still read: that work is evaluated first, and
        its fences cleared only once that evaluation has returned."""
        table, stats = self.bank.table, self.bank.stats
        t0 = time.perf_counter()
        claim = table.claim(layer, ids, keep, use=True)
        t1 = time.perf_counter()
        stats.plan_s += t1 - t0
        if claim.fences:
            mx.eval(claim.fences)  # earlier calls' compute, not a wait for expert bytes
            table.clear_fences(claim.fences)
            stats.readers_s += time.perf_counter() - t1
        return claim.slots

    def _undo(self) -> None:
        """Free every slot claimed on this thread and not filled: an exception is leaving
        ``acquire`` or ``stage``, and only read-ahead and a deferred read under way may keep a
        slot filling."""
        table = self.bank.table
        pending = set(self._pending[1].values()) if self._pending is not None else set()
        table.forget([s for s in table.unfilled() if s not in self._reads and s not in pending])

    def _read_now(self, layer: int, claimed: dict[int, int]) -> None:
        if claimed:
            self._count(layer, claimed, self._read(layer, claimed))

    def _count(self, layer: int, claimed: dict[int, int], written: int) -> None:
        stats = self.bank.stats
        stats.source_hits += len(claimed)
        stats.source_bytes += sum(self.bank.nbytes(layer, e) for e in claimed)
        stats.copied_bytes += written

    def _read(self, layer: int, claimed: dict[int, int]) -> int:
        """The misses' bytes into their slots (and their copies done); the bytes written. Any
        thread (a deferred read runs on the filler's): it touches no table and no stats."""
        bank = self.bank
        assert bank.memory is not None
        ids = list(claimed)
        if self.copier is not None and self.copier.on:
            per = max(1, STAGING_BYTES // bank.nbytes(layer, ids[0]))
            return sum(self._read_staged(layer, ids[i : i + per], claimed)
                       for i in range(0, len(ids), per))
        targets = [bank.memory.targets(claimed[e], bank.pieces(layer, e)) for e in ids]
        return int(bank.source.read_into(layer, ids, targets))

    def _defer(self, layer: int, claimed: dict[int, int]) -> None:
        for e in claimed:  # the manifest's layouts looked up here, on the model's thread
            self.bank.pieces(layer, e)
        fut = self._demand.submit(self._read, layer, dict(claimed))
        self._pending = (layer, claimed, fut)

    @property
    def deferred(self) -> bool:
        """A deferred read is under way (``complete`` has not run since)."""
        return self._pending is not None

    def complete(self) -> None:
        """Wait for the deferred read, if any: its slots then hold their experts (marked
        filled), or, if it failed, are freed (only once the read has stopped) and it raises."""
        if self._pending is None:
            return
        layer, claimed, fut = self._pending
        self._pending = None
        table, stats = self.bank.table, self.bank.stats
        t0 = time.perf_counter()
        try:
            written = fut.result()
        except BaseException:
            wait([fut])  # Ctrl-C while waiting: the read still writes the slots until it ends
            table.forget(list(claimed.values()))
            raise
        finally:
            stats.wait_s += time.perf_counter() - t0
        self._count(layer, claimed, written)
        table.filled(claimed.values())

    def _read_staged(self, layer: int, ids: list[int], claimed: dict[int, int]) -> int:
        """Read into pinned staging memory; as each window of an expert lands, copy it to its
        slot's tensors on the GPU's copy engine (``cuda_memory``) while the next windows are
        still read, so what is left after the last read is one window's copy; the bytes
        written, both copies counted."""
        bank, copier, memory = self.bank, self.copier, self.bank.memory
        assert memory is not None and copier is not None
        sizes = [bank.nbytes(layer, e) for e in ids]
        buf = copier.staging(sum(sizes))
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        base = buf.ctypes.data
        copied = [0] * len(ids)  # per expert, the bytes whose copy has started

        def landed(i: int, upto: int) -> None:
            if upto < sizes[i] and not copier.by_window:
                return
            # ``upto`` at or below what was copied: the expert failed its check and was read
            # again (``DaemonSource.read_into``), so its copies start again from its first byte.
            e, lo = ids[i], copied[i] if upto > copied[i] else 0
            _copy_span(copier, memory, bank.pieces(layer, e), claimed[e], base + starts[i],
                       lo, upto)
            copied[i] = max(lo, upto)

        try:
            written = bank.source.read_into(
                layer, ids, [[buf[a : a + n].data] for a, n in zip(starts, sizes, strict=True)],
                landed)
        finally:  # no copy may still read staging or write a slot the caller frees
            ok = copier.wait()
        if not ok:  # the copier gave up: write these slots from the host
            for e, a, n in zip(ids, starts, sizes, strict=True):
                memory.fill(claimed[e], bank.pieces(layer, e), buf[a : a + n])
        return written + sum(sizes)

    def stage(self, layer: int, guess: list[int]) -> None:
        """Start reading the guessed experts of ``layer`` that no slot holds into free slots,
        in the background. Never takes a slot that queued work reads, nor a kept expert's:
        only slots the policy ranks below the guess (``SlotTable.claim(ahead=True)``)."""
        if not guess:
            return
        _, table = self.bank.pool(layer, guess[0])
        self.sweep()
        try:
            claim = table.claim(layer, guess, take_fenced=False, ahead=True)
            assert not claim.fences
            for e, slot in claim.slots.items():
                key = (layer, e)
                fut = self._readers.submit(self._read_ahead, layer, e, slot)
                self._reads[slot] = (key, fut)
                self.guessed.add(key)
        except BaseException:
            self._undo()  # slots claimed and not handed to a reader
            raise
        self.bank.stats.staged += len(claim.slots)

    def _read_ahead(self, layer: int, expert: int, slot: int) -> int:
        """On a reader thread: the expert's bytes into its slot (on the source's read-ahead
        threads where it has them: ``read_ahead_into``, never queued before a demand read);
        the bytes written. On CUDA through this thread's own pinned staging and copy engine
        stream (``cuda_memory.Copier``), the copies done before it returns."""
        memory = self.bank.memory
        assert memory is not None
        source = self.bank.source
        read = getattr(source, "read_ahead_into", None) or source.read_into
        pieces = self.bank.pieces(layer, expert)
        copier = self._ahead_copier()
        if copier is None:
            return int(read(layer, [expert], [memory.targets(slot, pieces)]))
        n = self.bank.nbytes(layer, expert)
        buf = copier.staging(n)
        written = int(read(layer, [expert], [[buf[:n].data]]))
        try:
            _copy_span(copier, memory, pieces, slot, buf.ctypes.data, 0, n)
        finally:  # no copy may still read staging or write a slot once this returns
            ok = copier.wait()
        if not ok:  # the copier gave up: write the slot from the host
            memory.fill(slot, pieces, buf[:n])
        return written + n

    def _ahead_copier(self) -> Copier | None:
        """This reader thread's copier (its own staging and stream), where misses go through
        one (CUDA); None elsewhere or once the bank's copier is off."""
        if self.copier is None or not self.copier.on:
            return None
        copier = getattr(self._local, "copier", None)
        if copier is None:
            copier = self._local.copier = type(self.copier)()
            with self._lock:
                self._ahead_copiers.append(copier)
        return copier if copier.on else None

    def sweep(self) -> None:
        """Take in read-ahead that has finished (failed ones free their slot)."""
        for slot in [s for s, (_, fut) in self._reads.items() if fut.done()]:
            self.finish(slot)

    def finish(self, slot: int) -> bool:
        """Wait for the read-ahead into ``slot``; True if its bytes are in place."""
        table = self.bank.table
        assert table is not None
        key, fut = self._reads[slot]
        failed = fut.exception() is not None  # waits (an exception here leaves the read listed)
        del self._reads[slot]
        if failed:  # read again on demand if it is routed
            table.forget([slot])
            self.guessed.discard(key)
            return False
        table.filled([slot])
        self._underived.append(slot)
        self.bank.stats.source_bytes += self.bank.nbytes(*key)
        self.bank.stats.copied_bytes += fut.result()
        return True

    def finish_all(self) -> None:
        for slot in list(self._reads):
            self.finish(slot)

    def derive_staged(self) -> None:
        """Compute the derived arrays of slots read-ahead filled (on the model's thread)."""
        if self._underived and self.bank.memory is not None:
            slots, self._underived = self._underived, []
            try:
                self.bank.stats.copied_bytes += self.bank.memory.derive(slots)
            except BaseException:  # their derived arrays are not theirs: read them again
                self.bank.table.forget(slots)
                raise

    def close(self) -> None:
        """Wait for every read, then release the threads and the pinned staging (a deferred
        read's failure is raised after that)."""
        try:
            self.complete()
        finally:
            self._demand.shutdown(wait=True)
            for slot in list(self._reads):
                self._reads[slot][1].cancel()
            self._readers.shutdown(wait=True, cancel_futures=True)
            for copier in [self.copier, *self._ahead_copiers]:
                if copier is not None:
                    copier.close()


def _copy_span(copier: Copier, memory: PoolMemory, pieces: tuple[Piece, ...], slot: int, src: int,
               lo: int, hi: int) -> None:
    """Copy bytes [lo, hi) of an expert's blob, held at ``src``, to ``slot``'s tensors: each
    piece the span meets, the part of it inside the span."""
    for offset, n, key in pieces:
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            copier.copy(memory.address(key, slot) + a - offset, src + a, b - a)
