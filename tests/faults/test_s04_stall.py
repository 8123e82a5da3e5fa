"""Scenario 4: a stalled upstream. The read timeout fires within its setting + 1 s, the total
deadline bounds the retries, the client gets 504 upstream_timeout (retryable) and /healthz keeps
answering in < 100 ms the whole time."""

from __future__ import annotations

import os
import signal
import time

import pytest

from cachecd.errors import UpstreamTimeout
from tests.faults.figures import FIGURES
from tests.faults.probe import HealthProbe, record_health
from tests.faults.support import Model, fetch_verified

READ_S, TOTAL_S = 1.5, 5.0
ENV = {"CACHECD_READ_TIMEOUT": str(READ_S), "CACHECD_TOTAL_TIMEOUT": str(TOTAL_S)}


def _stall_windows(hub, at_least: int = 1) -> list[float]:  # type: ignore[no-untyped-def]
    """The stalls the hub timed, once it has timed ``at_least``: a stall is recorded when the hub
    notices the client hung up (it polls), which can come after the retry was served."""
    deadline = time.monotonic() + 60  # a bound on a hang, not a measure: the state ends it
    while len(hub.stalls) < at_least and time.monotonic() < deadline:
        time.sleep(0.02)
    return [round(t1 - t0, 3) for t0, t1 in hub.stalls]


def test_mid_body_stall_times_out_and_the_retry_serves_good_bytes(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    hub.faults.stall_after, hub.faults.times = 2048, 1
    d = pool.daemon(hub, [small], env=ENV)
    with HealthProbe(d.socket, d.pid) as probe, d.client() as c:
        fetch_verified(c, small, small.layers[0], [3])
        health = probe.stop()
    windows = _stall_windows(hub)
    assert len(windows) == 1
    FIGURES.setting("s04.read_timeout_setting_s", READ_S)
    FIGURES.peak("s04.read_timeout_fired_after_s_max", max(windows))
    assert READ_S - 0.1 <= windows[0] <= READ_S + 1.0, windows
    assert record_health("s04", health) < 100, health
    assert health["fails"] == 0


def test_persistent_stall_gives_504_within_the_total_deadline(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    hub.faults.stall_after = 2048
    d = pool.daemon(hub, [small], env=ENV)
    with HealthProbe(d.socket, d.pid) as probe, d.client() as c:
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout) as info:
            fetch_verified(c, small, small.layers[1], [4])
        took = time.monotonic() - t0
        health = probe.stop()
    assert info.value.retryable and info.value.http_status == 504
    windows = _stall_windows(hub)
    FIGURES.setting("s04.total_deadline_setting_s", TOTAL_S)
    FIGURES.peak("s04.error_after_s", round(took, 3))
    FIGURES.peak("s04.read_timeout_fired_after_s_max", max(windows))
    FIGURES.set("s04.attempts_before_504", len(windows))
    assert len(windows) >= 2  # retried, and bounded by the deadline
    assert all(w <= READ_S + 1.0 for w in windows), windows
    assert took <= TOTAL_S + 1.0, took
    assert record_health("s04", health) < 100, health
    assert health["fails"] == 0
    with d.client() as c:  # nothing was cached and nothing is stuck
        assert c.stats()["store"]["entries"] == 0 and c.stats()["inflight"] == 0


def test_proxy_that_never_forwards_headers_times_out_then_recovers(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    thread = pool.hub_thread(small)
    proxy = thread.proxy()
    proxy.toxics.timeout = 0  # swallow everything the CDN answers, forever
    d = pool.daemon(thread.hub, [small], env=ENV)
    with HealthProbe(d.socket, d.pid) as probe, d.client() as c:
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            fetch_verified(c, small, small.layers[2], [6])
        took = time.monotonic() - t0
        proxy.toxics.timeout = None
        fetch_verified(c, small, small.layers[2], [6])
        health = probe.stop()
    FIGURES.peak("s04.error_after_s", round(took, 3))
    FIGURES.set("s04.proxy_stalls", proxy.toxic_hits)
    assert proxy.toxic_hits >= 2
    assert took <= TOTAL_S + 1.0, took
    assert record_health("s04", health) < 100, health


def test_the_health_bar_sees_a_held_loop(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    """The bar subtracts only the machine's CPU waits: a daemon that is not answering (here
    stopped, as a loop held by a blocking call would be) still counts in full."""
    d = pool.daemon(pool.hub(small), [small])
    with HealthProbe(d.socket, d.pid) as probe:
        with d.client() as c:  # the probe has answered at least once before the hold
            assert c.health()["ok"]
        os.kill(d.pid, signal.SIGSTOP)
        time.sleep(0.3)  # the hold being measured, not a wait for a state
        os.kill(d.pid, signal.SIGCONT)
        with d.client() as c:
            assert c.health()["ok"]
        health = probe.stop()
    assert health["fails"] == 0
    assert health["own_max_ms"] >= 250, health
