"""The gate before a registered model's experts: its manifest's layout, checked.

No expert of a model flows, hit or miss, until its manifest's ranges have been checked against
the shards' safetensors headers at its commit (``manifest.hub_check.check_layout_at``): a cached
blob named by a swapped manifest is another expert's bytes, so a hit is no safer than a miss.
The registration checks when it can; a model registered without a check (no network, nothing
kept) is checked here at its first request, one check at a time per model. While a check cannot
run, requests get ``ManifestUnchecked`` (retryable), at once for ``RETRY_S`` after a failure
rather than each waiting on the endpoint again; a login the endpoint refuses is
``Unauthorized``, as the daemon's own fetches answer it (what to do is to log in).

Checks run on daemon threads: one stuck on a stalled endpoint must not hold the daemon's
shutdown, which waits for the loop's own executor.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cachecd.errors import (
    CachecdError,
    Gated,
    ManifestMismatch,
    ManifestUnchecked,
    Unauthorized,
    XetFormatError,
    XetProofError,
)
from cachecd.manifest.manifest import Manifest

log = logging.getLogger(__name__)

RETRY_S = 2.0


async def in_thread(fn: Callable[[Manifest], None], manifest: Manifest) -> None:
    """``fn(manifest)`` on a daemon thread, awaited."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(exc: BaseException | None) -> None:
        if not done.done():
            done.set_result(None) if exc is None else done.set_exception(exc)

    def run() -> None:
        try:
            fn(manifest)
        except BaseException as exc:  # handed to the awaiting task
            loop.call_soon_threadsafe(settle, exc)
        else:
            loop.call_soon_threadsafe(settle, None)

    threading.Thread(target=run, name="cachecd-manifest-check", daemon=True).start()
    await done


class LayoutGate:
    def __init__(self, check: Callable[[Manifest], None] | None) -> None:
        self._check = check
        self._locks: dict[str, asyncio.Lock] = {}
        self._failed: dict[str, tuple[float, ManifestUnchecked]] = {}

    async def ensure(self, model: Any) -> None:
        """Return once ``model``'s layout is checked (it sets ``model.layout_checked``); raise
        ``ManifestMismatch`` when it is refuted, else as the module docstring says."""
        m = model.manifest
        async with self._locks.setdefault(m.repo, asyncio.Lock()):
            if model.layout_checked:
                return
            failed = self._failed.get(m.repo)
            if failed is not None and time.monotonic() - failed[0] < RETRY_S:
                raise failed[1]
            try:
                await self._run(m)
            except ManifestUnchecked as exc:
                self._failed[m.repo] = (time.monotonic(), exc)
                raise
            self._failed.pop(m.repo, None)
            model.layout_checked = True
            log.info("layout_checked repo=%s revision=%s", m.repo, m.revision)

    async def _run(self, m: Manifest) -> None:
        try:
            if self._check is None:
                raise CachecdError("no layout check is configured")
            await in_thread(self._check, m)
        except (ManifestMismatch, Unauthorized, XetProofError, XetFormatError):
            raise  # a header that does not prove is the content store's fault: said as such
        except Gated as exc:  # as the daemon's own fetches answer a refused login
            raise Unauthorized(exc.message) from exc
        except CachecdError as exc:
            raise ManifestUnchecked(
                f"{m.key}: its manifest's expert layout has not been checked against the "
                f"shards' safetensors headers at that commit ({exc.message}); no expert of it "
                f"is served until it is: let the daemon reach its endpoint, or run `cachecd "
                f"setup --stream {m.key}` online (the headers are kept)") from exc
