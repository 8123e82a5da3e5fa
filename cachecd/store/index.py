"""The LMDB index: which blobs exist, where, how often they are used, pins and models.

Lives at ``CACHE_DIR0/index.lmdb``. Named databases:

    meta     b"schema_version" -> ascii int; b"fsck_checkpoint" -> last digest checked
    entries  digest (16 raw bytes) -> dir index, size, created (struct ``<HQd``)
    access   b"d" + digest -> count, last use;  b"m" + model key + NUL + layer, expert -> count,
             last use (struct ``<Qd``); coverage reads the b"m" rows
    pins     digest -> b""
    models   model key (utf-8) -> JSON record
    sources  digest + source key (16 + 16 raw bytes) -> origin (one byte): the exact bytes each
             blob was verified as (``sources.py``; schema 2). A row's sources go with the row.

Every write runs on the writer thread of ``IndexWriter`` (index_writer.py), whose invariants
(one writer, batched commits, map growth, a failed commit leaves the index unchanged) hold here.

Invariants:
- Access counts are recorded in memory and flushed every ``flush_every`` accesses or every
  ``flush_interval`` seconds; a crash loses at most that window of statistics, never an entry.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from cachecd import constants, errors
from cachecd.store import sources
from cachecd.store.index_writer import FLUSH, IndexWriter

log = logging.getLogger(__name__)

INDEX_DIRNAME = "index.lmdb"  # inside cache dir 0
_ENTRY = struct.Struct("<HQd")
_ACCESS = struct.Struct("<Qd")
_LAYER_EXPERT = struct.Struct(">ii")

# Migrations: schema version N -> N+1, run inside one write txn.
MIGRATIONS: dict[int, Callable[[lmdb.Transaction, Index], None]] = {1: sources.migrate_to_2}


@dataclass(frozen=True)
class Entry:
    dir_index: int
    size: int
    created: float


def digest_key(digest_hex: str) -> bytes:
    return bytes.fromhex(digest_hex)


def coverage_prefix(model_key: str) -> bytes:
    return b"m" + model_key.encode() + b"\x00"


def log_failure(fut: Future[None], what: str) -> None:
    """Log a write that failed where nobody waits on its Future."""

    def done(f: Future[None]) -> None:
        if f.exception() is not None:
            log.error("event=index_write_failed what=%s err=%s", what, f.exception())

    fut.add_done_callback(done)


class Index(IndexWriter):
    def __init__(
        self,
        path: Path,
        *,
        map_size: int | None = None,
        map_ceiling: int | None = None,
        flush_every: int = 1000,
        flush_interval: float = 1.0,
    ) -> None:
        path = Path(path)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        # sync and metasync: a commit returns once LMDB has synced its own file. Linux: the data
        # pages are fdatasync'd, then the meta page is written through an O_DSYNC fd. macOS:
        # LMDB's MDB_FDATASYNC is fcntl(F_FULLFSYNC) (mdb.c, `#if defined(__APPLE__)`) for the
        # data pages, and from LMDB 0.9.36 (ITS#10454; py-lmdb 3.0, which pyproject asks for on
        # macOS) the meta page gets one too; before, it stopped at O_DSYNC, short of the drive's
        # media. docs/daemon.md, "Durability on Linux and macOS".
        env = lmdb.open(
            str(path), map_size=map_size or constants.LMDB_MAP_SIZE, max_dbs=8,
            subdir=True, sync=True, metasync=True, readahead=False, meminit=False,
        )
        super().__init__(env, path, map_ceiling or constants.LMDB_MAP_CEILING, flush_interval)
        self.meta = self.env.open_db(b"meta")
        self.entries = self.env.open_db(b"entries")
        self.access = self.env.open_db(b"access")
        self.pins = self.env.open_db(b"pins")
        self.models = self.env.open_db(b"models")
        self.sources = self.env.open_db(b"sources")
        self._flush_every = flush_every
        self._pending_lock = threading.Lock()
        self._pending: dict[bytes, tuple[int, float]] = {}
        try:
            self._migrate()
        except BaseException:
            self.env.close()
            raise
        self._start()

    # ---- reads (any thread) ------------------------------------------------------------

    def load_entries(self) -> dict[str, Entry]:
        out: dict[str, Entry] = {}
        with self.read() as txn:
            for k, v in txn.cursor(db=self.entries):
                d, size, created = _ENTRY.unpack(v)
                out[k.hex()] = Entry(d, size, created)
        return out

    def load_pins(self) -> set[str]:
        with self.read() as txn:
            return {k.hex() for k in txn.cursor(db=self.pins).iternext(values=False)}

    def load_models(self) -> dict[str, dict[str, Any]]:
        with self.read() as txn:
            return {bytes(k).decode(): json.loads(bytes(v)) for k, v in txn.cursor(db=self.models)}

    def load_digest_access(self) -> dict[str, tuple[int, float]]:
        out: dict[str, tuple[int, float]] = {}
        with self.read() as txn:
            cur = txn.cursor(db=self.access)
            if cur.set_range(b"d"):
                for raw, v in cur:
                    k = bytes(raw)
                    if not k.startswith(b"d"):
                        break
                    out[k[1:].hex()] = _ACCESS.unpack(v)
        return out

    def access_counts(self, model_key: str) -> dict[tuple[int, int], tuple[int, float]]:
        prefix = coverage_prefix(model_key)
        out: dict[tuple[int, int], tuple[int, float]] = {}
        with self.read() as txn:
            cur = txn.cursor(db=self.access)
            if cur.set_range(prefix):
                for raw, v in cur:
                    k = bytes(raw)
                    if not k.startswith(prefix):
                        break
                    out[_LAYER_EXPERT.unpack(k[len(prefix):])] = _ACCESS.unpack(v)
        with self._pending_lock:
            for k, (n, last) in self._pending.items():
                if k.startswith(prefix):
                    le = _LAYER_EXPERT.unpack(k[len(prefix):])
                    old = out.get(le, (0, 0.0))
                    out[le] = (old[0] + n, max(old[1], last))
        return out

    def get_meta(self, key: bytes) -> bytes | None:
        with self.read() as txn:
            value = txn.get(key, db=self.meta)
            return bytes(value) if value is not None else None

    # ---- writes (Futures) --------------------------------------------------------------

    def _change(self, db: Any, rows: list[tuple[bytes, bytes | None]]) -> Future[None]:
        """Put each (key, value); a value of None deletes the key."""
        return self.submit(self._change_op(db, rows), frees=all(v is None for _, v in rows))

    @staticmethod
    def _change_op(db: Any, rows: list[tuple[bytes, bytes | None]]
                   ) -> Callable[[lmdb.Transaction], None]:
        def op(txn: lmdb.Transaction) -> None:
            for k, v in rows:
                if v is None:
                    txn.delete(k, db=db)
                else:
                    txn.put(k, v, db=db)

        return op

    def put_entry(self, digest_hex: str, entry: Entry,
                  source: tuple[str, bytes] | None = None) -> Future[None]:
        """One row and, in the same txn, the (source key, origin) its bytes were verified as."""
        row = self._change_op(self.entries, [
            (digest_key(digest_hex), _ENTRY.pack(entry.dir_index, entry.size, entry.created))])
        put = sources.put_op(self, [(digest_hex, *source)] if source is not None else [])

        def op(txn: lmdb.Transaction) -> None:
            row(txn)
            put(txn)

        return self.submit(op)

    def put_entries(self, entries: dict[str, Entry]) -> Future[None]:
        return self._change(self.entries, [
            (digest_key(d), _ENTRY.pack(e.dir_index, e.size, e.created)) for d, e in entries.items()
        ])

    def delete_entries(self, digests: list[str]) -> Future[None]:
        """Rows and, in the same txn, the sources they were verified as."""
        keys = [digest_key(d) for d in digests]

        def op(txn: lmdb.Transaction) -> None:
            for k in keys:
                txn.delete(k, db=self.entries)
                self.delete_prefix(txn, self.sources, k)

        return self.submit(op, frees=True)

    @staticmethod
    def delete_prefix(txn: lmdb.Transaction, db: Any, prefix: bytes) -> None:
        cur = txn.cursor(db=db)
        if cur.set_range(prefix):
            while bytes(cur.key()).startswith(prefix):
                if not cur.delete():
                    break

    def set_pin(self, digest_hex: str, pinned: bool) -> Future[None]:
        return self._change(self.pins, [(digest_key(digest_hex), b"" if pinned else None)])

    def put_model(self, key: str, record: dict[str, Any]) -> Future[None]:
        value = json.dumps(record, sort_keys=True).encode()
        return self._change(self.models, [(key.encode(), value)])

    def delete_model(self, key: str) -> Future[None]:
        return self._change(self.models, [(key.encode(), None)])

    def put_meta(self, key: bytes, value: bytes | None) -> Future[None]:
        return self._change(self.meta, [(key, value)])

    # ---- access statistics (batched) ---------------------------------------------------

    def record_access(
        self, digest_hex: str, model_key: str | None, layer: int, expert: int, now: float
    ) -> None:
        keys = [b"d" + digest_key(digest_hex)]
        if model_key is not None and layer >= 0 and expert >= 0:
            keys.append(coverage_prefix(model_key) + _LAYER_EXPERT.pack(layer, expert))
        with self._pending_lock:
            for k in keys:
                n, _ = self._pending.get(k, (0, 0.0))
                self._pending[k] = (n + 1, now)
            wake = len(self._pending) >= self._flush_every and not self._flush_requested
            if wake:
                self._flush_requested = True
        if wake:
            self._queue.put(FLUSH)

    def flush_access(self) -> None:
        """Write pending access stats now (from any thread; waits for the writer)."""
        self.submit(self._flush_op_from_pending()).result()

    def _take_pending(self) -> dict[bytes, tuple[int, float]]:
        with self._pending_lock:
            taken, self._pending = self._pending, {}
        return taken

    def _flush_op_from_pending(self) -> Callable[[lmdb.Transaction], None]:
        taken = self._take_pending()

        def op(txn: lmdb.Transaction) -> None:
            for k, (n, last) in taken.items():
                old = txn.get(k, db=self.access)
                count, prev = _ACCESS.unpack(old) if old else (0, 0.0)
                txn.put(k, _ACCESS.pack(count + n, max(prev, last)), db=self.access)

        return op

    def _flush_due(self) -> bool:
        return len(self._pending) >= self._flush_every

    def _flush_pending(self) -> None:
        if not self._pending:
            return
        try:
            self._write(self._flush_op_from_pending())
        except errors.CachecdError as exc:
            # Statistics are best effort: losing a batch must not take the writer down.
            log.warning("event=access_flush_failed err=%s", exc)

    # ---- schema ------------------------------------------------------------------------

    def _migrate(self) -> None:
        want = constants.INDEX_SCHEMA_VERSION

        with self.read() as rtxn:
            raw = rtxn.get(b"schema_version", db=self.meta)
        if raw is not None and int(raw) == want:
            return  # no write at open: a full disk must not stop the cache from serving

        def op(txn: lmdb.Transaction) -> int:
            raw = txn.get(b"schema_version", db=self.meta)
            have = int(raw) if raw else want
            if have > want:
                raise errors.Internal(
                    f"index {self.path} has schema {have}, newer than this cachecd ({want}); "
                    "upgrade cachecd"
                )
            while have < want:
                MIGRATIONS[have](txn, self)
                have += 1
            txn.put(b"schema_version", str(want).encode(), db=self.meta)
            return have

        self._write(op)

