"""Single-flight: at most one execution of the work for a key at a time. The one used by the Hub
client (one resolve per file) and by the daemon's misses (one fetch per expert).

Invariants:
- While work for a key runs, every caller of that key waits on the same future and gets the same
  result or the same exception object.
- The work is shielded: cancelling a waiter (a client that disconnected) never cancels the work.
- A key is forgotten the moment its work finishes, so the next call after a failure runs again.
- ``do``/``do_many`` run the work themselves. A caller that runs its own (``claim``, then
  ``settle`` each key it claimed) keeps the same rules: one future per key in flight, settled
  once, and only the claimer's own future is settled when it names it.
- The running tasks are referenced here until they finish (asyncio keeps only weak references).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from cachecd import errors

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

log = logging.getLogger(__name__)


class SingleFlight(Generic[K, V]):
    """Deduplicates concurrent work by key (one fetch per expert in flight)."""

    def __init__(self) -> None:
        self._futures: dict[K, asyncio.Future[V]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.executions = 0  # how many times work actually started (for tests and /metrics)

    def __len__(self) -> int:
        return len(self._futures)

    def in_flight(self, key: K) -> bool:
        return key in self._futures

    async def do(self, key: K, factory: Callable[[], Awaitable[V]]) -> V:
        """Run ``factory()`` for ``key`` unless it is already running; await its outcome."""
        fut = self._futures.get(key)
        if fut is None:
            fut = self.claim([key])[key]
            self._start(self._run_one(key, fut, factory))
        return await asyncio.shield(fut)

    async def do_many(
        self,
        keys: Iterable[K],
        factory: Callable[[list[K]], Awaitable[Mapping[K, V | BaseException]]],
    ) -> dict[K, V | BaseException]:
        """Batch form: one ``factory(missing)`` task for the keys not in flight; wait on all keys.

        ``factory`` gets the keys nobody is working on yet and returns, per key, a value or an
        exception (a key it leaves out gets ``errors.Internal``). The result maps every requested
        key to its value or exception; nothing is raised for a per-key failure.
        """
        wanted = list(dict.fromkeys(keys))
        missing = [k for k in wanted if k not in self._futures]
        if missing:
            claimed = self.claim(missing)
            self._start(self._run_many(claimed, factory))
        # No await since the claim, so every wanted key has a future in the map.
        waits = [asyncio.shield(self._futures[k]) for k in wanted]
        done = await asyncio.gather(*waits, return_exceptions=True)
        return dict(zip(wanted, done, strict=True))

    def cancel_all(self) -> None:
        """Cancel every running work (daemon shutdown); waiters see CancelledError."""
        for task in list(self._tasks):
            task.cancel()

    async def wait_idle(self) -> None:
        """Wait until no work is running."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def waiting(self, key: K) -> asyncio.Future[V] | None:
        """The future of ``key``'s work in flight, if any."""
        return self._futures.get(key)

    def claim(self, keys: list[K]) -> dict[K, asyncio.Future[V]]:
        """A new future for each key (none of them in flight): the caller runs the work and
        ``settle``s every key it claimed."""
        loop = asyncio.get_running_loop()
        out: dict[K, asyncio.Future[V]] = {}
        for key in keys:
            fut: asyncio.Future[V] = loop.create_future()
            # Retrieve the exception even when every waiter left, so asyncio does not warn.
            fut.add_done_callback(_consume)
            self._futures[key] = out[key] = fut
        return out

    def _start(self, coro: Awaitable[None]) -> None:
        self.executions += 1
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def settle(self, key: K, outcome: V | BaseException,
               fut: asyncio.Future[V] | None = None) -> None:
        """End ``key``'s flight with a value or an exception; with ``fut``, only that future
        (a newer flight of the same key is left alone). Nothing in flight: nothing to do."""
        fut = fut if fut is not None else self._futures.get(key)
        if fut is not None:
            self._settle(key, fut, outcome)

    def _settle(self, key: K, fut: asyncio.Future[V], outcome: V | BaseException) -> None:
        if self._futures.get(key) is fut:
            del self._futures[key]
        if fut.done():
            return
        if isinstance(outcome, asyncio.CancelledError):
            fut.cancel()
        elif isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)

    async def _run_one(
        self, key: K, fut: asyncio.Future[V], factory: Callable[[], Awaitable[V]]
    ) -> None:
        try:
            value = await factory()
        except BaseException as exc:  # handed to every waiter
            self._settle(key, fut, exc)
            if not isinstance(exc, Exception):
                raise
        else:
            self._settle(key, fut, value)

    async def _run_many(
        self,
        futs: dict[K, asyncio.Future[V]],
        factory: Callable[[list[K]], Awaitable[Mapping[K, V | BaseException]]],
    ) -> None:
        try:
            results = await factory(list(futs))
        except BaseException as exc:  # every key of the batch fails
            for key, fut in futs.items():
                self._settle(key, fut, exc)
            if not isinstance(exc, Exception):
                raise
            return
        for key, fut in futs.items():
            outcome = results.get(
                key, errors.Internal(f"batch work returned no result for {key!r}")
            )
            self._settle(key, fut, outcome)


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
