"""The sources each cached blob was verified as: provenance, so a blob serves only its own
experts.

A blob is named by its digest (what the bytes are). A source key (``manifest.provenance``) names
exact bytes of an exact shard: (shard sha256, start, length) of each of an expert's ranges. A row
here says "the bytes at this source hash to this digest", and how that was learnt:

    ORIGIN_SOURCE   fetched from the model's source (the Hub, a mirror) at those ranges, hashed here
    ORIGIN_PEER     a peer stated it served those ranges; the hash was checked here
    ORIGIN_ADOPTED  a row from before schema 2, attributed once by the registered manifests

Invariants:
- A hit for an expert counts only if its source key is among its blob's sources (the daemon's
  ``MissFiller.missing``): a set look-up in memory (``Ledger.sources``), no LMDB read per hit.
- A source is added only after bytes read from that source (or stated by a peer for it) hashed
  to the digest; a commit writes it before the blob's file and row (commit.py,
  ``BlobCommitter._write_once``), so a blob adopted by recovery after a crash in between still
  has it. A row's sources are deleted with it, in the same txn (``Index.delete_entries``).
  A source row left without its blob (an eviction raced the add) is still true, since the
  shard's sha256 pins its bytes: ``load`` skips it while the digest has no row, and it counts
  again, rightly, once those bytes are cached again.
- Rows from before schema 2 have none: ``PENDING`` is set by the migration, and the daemon
  attributes each such blob once (``adopt``) where every registered expert that claims its digest
  has the same source key; the others serve nothing until one of their experts' ranges is
  fetched and verified again (docs/cache.md).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import Any

import lmdb

Index = Any  # store.index.Index, which imports this module (its migration to schema 2)

ORIGIN_SOURCE = b"s"
ORIGIN_PEER = b"p"
ORIGIN_ADOPTED = b"a"
PENDING = b"provenance_pending"  # in meta: rows from before schema 2 wait for ``adopt``


def row_key(digest: str, source: str) -> bytes:
    return bytes.fromhex(digest) + bytes.fromhex(source)


def load(index: Index, digests: Collection[str]) -> dict[str, set[str]]:
    """digest -> its source keys, for the digests the index has rows for."""
    out: dict[str, set[str]] = {}
    with index.read() as txn:
        for raw in txn.cursor(db=index.sources).iternext(values=False):
            k = bytes(raw)
            digest = k[:16].hex()
            if digest in digests:
                out.setdefault(digest, set()).add(k[16:].hex())
    return out


def put_op(index: Index, rows: list[tuple[str, str, bytes]]) -> Callable[[lmdb.Transaction], None]:
    """An op for ``Index.submit``: put each (digest, source, origin)."""

    def op(txn: lmdb.Transaction) -> None:
        for digest, source, origin in rows:
            txn.put(row_key(digest, source), origin, db=index.sources)

    return op


def put(index: Index, rows: list[tuple[str, str, bytes]]) -> Future[None]:
    return index.submit(put_op(index, rows))


def migrate_to_2(txn: lmdb.Transaction, index: Index) -> None:
    """Schema 1 -> 2: the sources table is new and empty; blobs cached before get theirs once,
    from the registered manifests, when the daemon has loaded them (``PENDING``)."""
    if txn.stat(index.entries)["entries"]:
        txn.put(PENDING, b"1", db=index.meta)
