"""The registered models' records, kept in memory and in the index's ``models`` table.

Invariants:
- A record is visible to ``get`` as soon as ``put`` returns; durable once the returned Future
  completes.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from cachecd.store.index import Index, log_failure


class ModelRecords:
    def __init__(self, index: Index) -> None:
        self.index = index
        self._models = index.load_models()
        self._models_mu = threading.Lock()

    def put(self, key: str, record: dict[str, Any]) -> Future[None]:
        """Visible to ``get`` at once; durable when the returned Future completes
        (``await asyncio.wrap_future(...)`` from async code)."""
        with self._models_mu:
            self._models[key] = dict(record)
        fut = self.index.put_model(key, record)
        log_failure(fut, "put_model")
        return fut

    def delete(self, key: str) -> Future[None]:
        with self._models_mu:
            self._models.pop(key, None)
        return self.index.delete_model(key)

    def get(self, key: str) -> dict[str, Any] | None:
        with self._models_mu:
            rec = self._models.get(key)
            return dict(rec) if rec is not None else None

    def all(self) -> list[dict[str, Any]]:
        """Every registered model record, each with its ``key`` added."""
        with self._models_mu:
            return [{**rec, "key": key} for key, rec in sorted(self._models.items())]
