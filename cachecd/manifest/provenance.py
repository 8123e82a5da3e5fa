"""Where an expert's bytes come from: its source key.

An expert's source key is the xxh3-128 of its byte ranges as (shard sha256, start, length)
tuples, in order: the exact bytes of which exact file it is. The digest says what the bytes
are; the source key says whose bytes they are. The store keeps, for each blob, the source keys it
was verified as (``store.index``), and a cached blob counts for an expert only if the expert's
source key is among them: a manifest that gives expert (1,0) the digest of (1,1) cannot make a
hit of (1,1)'s blob, because (1,0)'s own ranges were never verified to hash to that digest.

Invariant: the key depends on the shard's content (its sha256, as the Hub's X-Linked-Etag and the
manifest's ``FileInfo`` give it), never on its name, repo or revision: the same bytes of the same
shard under another revision have the same key (a revision delta reuses them); the same expert
moved to another shard, or to other offsets, has another.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

import xxhash

from cachecd.manifest.entries import ByteRange, FileInfo

_RANGE = struct.Struct("<QQ")


def source_key(ranges: Iterable[ByteRange], files: Mapping[str, FileInfo]) -> str:
    """The source key (32 hex characters) of these ranges of ``files``' shards."""
    h = xxhash.xxh3_128()
    for r in ranges:
        sha = files[r.file].sha256 if r.file in files else ""
        h.update(sha.encode() + b"\x00" + _RANGE.pack(r.start, r.length))
    return h.hexdigest()
