"""Scenario 15: shutdown, restart and the client. SIGTERM with 10 fetches in flight drains them
within shutdown_timeout (they are committed; temps, sockets and the LMDB lock are gone; exit 0).
With no daemon the client raises DaemonUnavailable within 100 ms. A client that was connected
across a restart retries its idempotent requests on a fresh connection."""

from __future__ import annotations

import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cachecd.errors import CachecdError, DaemonUnavailable
from cachecd_client import Client
from tests.faults.figures import FIGURES
from tests.faults.probe import run_delay_s
from tests.faults.support import Model, fetch_verified, files_under, fsck_exit_code, new_dir

SHUTDOWN_S = 5.0


def test_sigterm_drains_ten_fetches_in_flight(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    hub.faults.delay = 1.5
    d = pool.daemon(hub, [small], args=["--max-parallel", "16"],
                    env={"CACHECD_SHUTDOWN_TIMEOUT": str(SHUTDOWN_S)})
    layer = small.layers[3]

    def ask(expert: int) -> str:
        with d.client(timeout=30) as c:
            try:
                fetch_verified(c, small, layer, [expert])
                return "bytes"
            except CachecdError as exc:
                return exc.code

    with ThreadPoolExecutor(10) as ex:
        futures = [ex.submit(ask, e) for e in range(10)]
        deadline = time.monotonic() + 20
        while hub.in_flight < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        in_flight = hub.in_flight
        assert in_flight == 10
        t0 = time.monotonic()
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(SHUTDOWN_S + 10)
        took = time.monotonic() - t0
        outcomes = [f.result() for f in futures]
    FIGURES.set("s15.fetches_in_flight_at_sigterm", in_flight)
    FIGURES.setting("s15.shutdown_timeout_s", SHUTDOWN_S)
    FIGURES.set("s15.drain_and_exit_s", round(took, 3))
    FIGURES.set("s15.client_outcomes", ", ".join(f"{o} x{outcomes.count(o)}" for o in sorted(set(outcomes))))
    assert code == 0 and took <= SHUTDOWN_S + 1.0, (code, took)
    assert set(outcomes) <= {"bytes", "daemon_unavailable", "shutting_down"}, outcomes
    assert not d.socket.exists() and not Path(str(d.socket) + ".data").exists()
    assert not files_under(d.cache_dir / "tmp")
    assert fsck_exit_code(d.cache_dir) == 0  # takes the cache lock: the daemon let go of it
    d.start()
    with d.client() as c:
        assert c.stats()["store"]["entries"] == 10  # every fetch in flight was committed
        hub.clear_records()
        fetch_verified(c, small, layer, list(range(10)))
    assert hub.count("cdn_get") == 0


def _time_unavailable(path: Path) -> tuple[float, float]:
    """The longest a client took to raise DaemonUnavailable: (wall, own), own being wall less
    the time this thread waited for a CPU that the machine's other work held (probe.py)."""
    times = []
    for call in (lambda c: c.expert("faults/small", 1, 0), lambda c: c.health()):
        w0, t0 = run_delay_s(), time.perf_counter()
        with pytest.raises(DaemonUnavailable):
            with Client(path, timeout=5) as c:
                call(c)
        wall = time.perf_counter() - t0
        times.append((wall, max(0.0, wall - (run_delay_s() - w0))))
    return max(t[0] for t in times), max(t[1] for t in times)


def test_client_without_a_daemon_fails_fast() -> None:
    root = new_dir("cdc")
    missing = root / "none.sock"
    stale = root / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()
    (wall_a, own_a), (wall_b, own_b) = _time_unavailable(missing), _time_unavailable(stale)
    FIGURES.peak("s15.daemon_unavailable_ms_max", round(1000 * max(wall_a, wall_b), 2))
    FIGURES.peak("s15.daemon_unavailable_own_ms_max", round(1000 * max(own_a, own_b), 2))
    assert max(own_a, own_b) < 0.1, (wall_a, own_a, wall_b, own_b)


def test_connected_client_retries_after_a_restart(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    d = pool.daemon(hub, [small])
    layer = small.layers[4]
    with d.client() as c:
        fetch_verified(c, small, layer, [0])  # a pooled data connection and a control one
        assert c.health()["ok"]
        assert d.stop() == 0
        t0 = time.perf_counter()
        with pytest.raises(DaemonUnavailable):
            c.health()
        FIGURES.peak("s15.daemon_unavailable_ms_max", round(1000 * (time.perf_counter() - t0), 2))
        d.start()
        retried = 0
        assert c.health()["ok"]  # same client object: reconnects on its own
        retried += 1
        fetch_verified(c, small, layer, [0, 1])
        retried += 1
    FIGURES.set("s15.calls_of_one_client_answered_across_a_restart", retried)


def test_sigterm_cancels_fetches_that_outlast_shutdown_timeout(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    hub.faults.delay = 30.0  # the upstream answers long after the daemon must be gone
    d = pool.daemon(hub, [small], env={"CACHECD_SHUTDOWN_TIMEOUT": "1.5"})
    layer = small.layers[0]

    def ask(expert: int) -> str:
        with d.client(timeout=30) as c:
            try:
                fetch_verified(c, small, layer, [expert])
                return "bytes"
            except CachecdError as exc:
                return exc.code

    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(ask, e) for e in range(4)]
        deadline = time.monotonic() + 20
        while hub.in_flight < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(20)
        took = time.monotonic() - t0
        outcomes = [f.result() for f in futures]
    FIGURES.set("s15.cancelled_drain_exit_s", round(took, 3))
    assert code == 0 and took <= 1.5 + 1.0, (code, took)
    assert "bytes" not in outcomes
    assert not files_under(d.cache_dir / "tmp")
    assert fsck_exit_code(d.cache_dir) == 0
