"""Running one upstream request to its end: the parallel limit, the host's wait, retries.

Invariants (``hub_client.HubClient`` sends every request through ``Retrier.run``):
- At most ``max_parallel`` attempts are in flight at once; an attempt starts only after its
  host's ``not_before`` (a server's Retry-After or RateLimit wait, or a RateLimit that said no
  requests are left in the window). The Hub's CDN is another host than its ``/resolve``, so a
  wait told by the resolvers does not hold up its byte fetches.
- A ``Transient`` failure is retried after capped, jittered exponential backoff (or the server's
  wait, whichever is longer) while attempts remain and the wait ends before the deadline; then
  its ``error`` is raised. Any other exception is raised at once.
- When the deadline passes while a retry waits for its turn, the caller gets the fault that made
  it retry, not the wait.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from cachecd import errors
from cachecd.upstream import hub_http as hh

log = logging.getLogger(__name__)


class Transient(Exception):
    """A failure worth retrying; ``error`` is what the caller sees if retries run out."""

    def __init__(self, error: errors.CachecdError, fault: str, wait: float | None = None) -> None:
        super().__init__(error.message)
        self.error, self.fault, self.wait = error, fault, wait


class DeadlinePassed(errors.UpstreamTimeout):
    """The total deadline passed before an attempt could start."""


# A host that refuses the connection (down, a wrong port, DNS) rarely comes back within the
# backoff: a couple of quick tries, then the caller hears it within seconds, not minutes.
CONNECT_RETRIES = 2


class Retrier:
    def __init__(
        self,
        counters: Counter[str],
        *,
        max_parallel: int,
        max_retries: int,
        backoff_base: float,
        backoff_cap: float,
        read_timeout: float,
        total_timeout: float,
    ) -> None:
        self.max_retries, self.total_timeout = max_retries, total_timeout
        self.backoff_base, self.backoff_cap = backoff_base, backoff_cap
        self.read_timeout = read_timeout
        self.in_flight = 0
        # Told each attempt's kind and seconds (the daemon's latency histogram), if set.
        self.observe: Callable[[str, float], None] | None = None
        self._counters = counters
        self._sem = asyncio.Semaphore(max_parallel)
        self._not_before: dict[str, float] = {}  # host -> no attempt starts before (monotonic)
        self._rng = random.Random()

    async def run(
        self, url: str, once: Callable[[], Awaitable[Any]], deadline: float | None = None,
        kind: str = "range",
    ) -> Any:
        """``once()`` under the parallel limit and the host's wait, retrying transient faults;
        ``kind`` ("resolve", "range") names its attempts to ``observe``."""
        parts = urlsplit(url)
        host = parts.netloc
        deadline = deadline or time.monotonic() + self.total_timeout
        failure: Transient | None = None
        for attempt in range(self.max_retries + 1):
            try:
                return await self._attempt(host, once, f"{parts.scheme}://{host}", kind)
            except Transient as exc:
                failure = exc
            except DeadlinePassed:
                if failure is None:
                    raise
                raise failure.error from None
            self._counters[f"faults_{failure.fault}"] += 1
            if failure.wait is not None:
                self.pause(url, failure.wait)
            delay = max(
                hh.backoff_delay(attempt, self.backoff_base, self.backoff_cap, self._rng),
                failure.wait or 0.0,
            )
            last = CONNECT_RETRIES if failure.fault == "connect" else self.max_retries
            if attempt >= last or time.monotonic() + delay > deadline:
                break
            self._counters["retries"] += 1
            log.warning(
                "upstream retry host=%s attempt=%d fault=%s delay_s=%.2f error=%s",
                host, attempt + 1, failure.fault, delay, failure.error.message,
            )
            await asyncio.sleep(delay)
        assert failure is not None
        raise failure.error

    def pause(self, url: str, seconds: float) -> None:
        """No attempt to ``url``'s host starts for ``seconds`` (a server's wait)."""
        host = urlsplit(url).netloc
        self._not_before[host] = max(self._not_before.get(host, 0.0), time.monotonic() + seconds)

    async def _attempt(self, host: str, once: Callable[[], Awaitable[Any]], origin: str,
                       kind: str) -> Any:
        # Wait before taking a slot, so requests told to wait do not hold up the others.
        while (wait := self._not_before.get(host, 0.0) - time.monotonic()) > 0:
            await asyncio.sleep(wait)
        async with self._sem:
            while (wait := self._not_before.get(host, 0.0) - time.monotonic()) > 0:
                await asyncio.sleep(wait)  # told to wait while queued for a slot
            self.in_flight += 1
            self._counters["peak_in_flight"] = max(
                self._counters["peak_in_flight"], self.in_flight
            )
            started = time.monotonic()
            try:
                return await once()
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                raise Transient(unreachable(origin, exc), "connect") from exc
            except TimeoutError as exc:
                raise Transient(
                    errors.UpstreamTimeout(
                        f"no data from {host} within the timeout (read {self.read_timeout}s, "
                        f"total {self.total_timeout}s); the upstream stalled"
                    ),
                    "timeout",
                ) from exc
            except aiohttp.ClientPayloadError as exc:
                raise Transient(
                    errors.UpstreamError(f"{host} cut the body short: {exc}"), "truncated"
                ) from exc
            except aiohttp.ClientResponseError as exc:  # aiohttp could not parse the answer
                # Not retried: the same server answers the same way. Its message only: the
                # error's repr holds the request's headers, the token among them.
                raise errors.UpstreamError(f"{host} sent an answer that cannot be read (HTTP "
                                           f"{exc.status}: {exc.message}); try again later, or "
                                           "another endpoint") from None
            except (aiohttp.ClientConnectionError, ConnectionError) as exc:
                raise Transient(
                    errors.UpstreamError(
                        f"connection to {host} failed: {exc.__class__.__name__}: {exc}"
                    ),
                    "connection",
                ) from exc
            finally:
                self.in_flight -= 1
                if self.observe is not None:
                    self.observe(kind, time.monotonic() - started)


def unreachable(origin: str, exc: BaseException) -> errors.UpstreamError:
    """One line for a connection that could not be made: the endpoint and the reason, not the
    client library's exception text."""
    os_error = getattr(exc, "os_error", None)
    number = getattr(os_error, "errno", None)
    if isinstance(exc, TimeoutError):
        reason = "no connection within the connect timeout"
    elif isinstance(number, int) and number > 0 and not isinstance(os_error, socket.gaierror):
        reason = os.strerror(number)  # "Connection refused", not asyncio's "Connect call failed"
    else:
        reason = getattr(os_error, "strerror", None) or str(os_error or exc)
    return errors.UpstreamError(
        f"cannot reach {origin} ({reason}): the endpoint is down or unreachable; check the "
        "network and --endpoint / HF_ENDPOINT (the next request tries again)")
