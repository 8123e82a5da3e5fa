"""Blobs cached before index schema 2 get their source once, from the registered manifests.

Schema 2 records, for each blob, the source keys (exact shard bytes, ``manifest.provenance``) it
was verified as; rows from before have none, and a blob without one is a hit for no expert. To
spare a re-download of a whole cache, the first daemon to open such an index (``store.sources``'
``PENDING``) attributes each such blob where every expert the registered manifests give its digest
has one and the same source key: the bytes were verified as that digest, and only one source
claims it. A digest claimed by experts at different sources (an alias, or a revision that moved
it) gets none: its experts are fetched and verified against their own ranges when first needed
(no second copy of the bytes when they match). This runs once: its result and the end of
``PENDING`` commit in one txn. docs/cache.md, "Provenance".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from cachecd.store.store import Store

log = logging.getLogger(__name__)


async def adopt_pre_provenance(store: Store, models: Iterable[Any]) -> int:
    """Attribute the blobs from before schema 2 (``models``: the registrations loaded from the
    index); returns how many got a source. Nothing to do (0) once done."""
    if not store.provenance_pending():
        return 0
    manifests = [m.manifest for m in models]
    return await asyncio.to_thread(_adopt, store, manifests)


def _adopt(store: Store, manifests: list[Any]) -> int:
    claims: dict[str, set[str]] = {}
    for m in manifests:
        hexes, keys = m.digests.tobytes().hex(), m.source_keys()
        for i in range(m.n_experts):
            claims.setdefault(hexes[32 * i:32 * i + 32], set()).add(keys[i])
    left = store.unattributed()
    found = {d: next(iter(claims[d])) for d in left if len(claims.get(d, ())) == 1}
    store.adopt_sources(found)
    log.info("event=provenance_adopted blobs=%d attributed=%d reverify=%d",
             len(left), len(found), len(left) - len(found))
    return len(found)
