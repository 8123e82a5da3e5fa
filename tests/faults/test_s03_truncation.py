"""Scenario 3: bodies cut short or reset (FakeHub knobs and the TCP proxy's toxics). Retries are
bounded, the temp is gone, the reservation is released, and fds/tasks return to the baseline
(checked by the pool at teardown)."""

from __future__ import annotations

import pytest

from cachecd import constants
from cachecd.errors import BadUpstreamRange, UpstreamError
from tests.fakes.fake_hub import Faults
from tests.fakes.fault_proxy import Toxics
from tests.faults.figures import FIGURES
from tests.faults.support import Model, fetch_verified, files_under


@pytest.fixture(scope="module")
def setup(small: Model, module_pool):  # type: ignore[no-untyped-def]
    """One daemon for the recoverable cases; each test sets its own faults."""
    thread = module_pool.hub_thread(small)
    return thread, module_pool.daemon(thread.hub, [small])


@pytest.fixture
def fresh(setup):  # type: ignore[no-untyped-def]
    thread, d = setup
    thread.hub.faults = Faults()
    thread.hub.clear_records()
    return thread.hub, thread, d


def _cdn_gets(hub) -> int:  # type: ignore[no-untyped-def]
    return hub.count("cdn_get")


@pytest.mark.parametrize("knob", ["truncate_after", "reset_after"])
def test_hub_cuts_the_body_twice_then_the_retry_serves_good_bytes(small: Model, fresh, knob: str) -> None:  # type: ignore[no-untyped-def]
    hub, _, d = fresh
    setattr(hub.faults, knob, 3000)
    hub.faults.times = 2
    with d.client() as c:
        fetch_verified(c, small, small.layers[0], [1 if knob == "reset_after" else 2])
        stats = c.stats()
    assert _cdn_gets(hub) == 3  # two cut answers, one good
    assert sum(hub.cuts.values()) == 2
    assert stats["store"]["reserved"] == 0 and stats["inflight"] == 0
    FIGURES.add("s03.cut_bodies_recovered", sum(hub.cuts.values()))


@pytest.mark.parametrize("toxic", ["limit_data", "reset_peer"])
def test_proxy_cuts_the_connection_twice_then_the_retry_serves_good_bytes(small: Model, fresh, toxic: str) -> None:  # type: ignore[no-untyped-def]
    hub, thread, d = fresh
    # A new proxy, and every signed URL handed out so far now gets 403: the daemon resolves
    # again and its next connections are the proxy's first (pooled ones went elsewhere).
    proxy = thread.proxy()
    proxy.toxics = Toxics(connections=2, **{toxic: 1500})
    hub.invalidate_urls()
    with d.client() as c:
        fetch_verified(c, small, small.layers[1], [2 if toxic == "reset_peer" else 3])
        assert c.stats()["store"]["reserved"] == 0
    assert proxy.toxic_hits == 2
    FIGURES.add("s03.cut_connections_recovered", proxy.toxic_hits)


def test_a_body_always_cut_fails_after_bounded_retries_and_leaves_nothing(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    hub.faults.truncate_after = 3000
    d = pool.daemon(hub, [small], env={"CACHECD_TOTAL_TIMEOUT": "4"})
    with d.client() as c:
        with pytest.raises((UpstreamError, BadUpstreamRange)) as info:
            fetch_verified(c, small, small.layers[2], [3])
        stats = c.stats()
    attempts = _cdn_gets(hub)
    FIGURES.set("s03.attempts_when_always_cut", attempts)
    FIGURES.set("s03.error_when_always_cut", info.value.code)
    assert 2 <= attempts <= 1 + constants.MAX_RETRIES
    assert stats["store"]["reserved"] == 0 and stats["store"]["entries"] == 0
    assert stats["inflight"] == 0
    assert not files_under(d.cache_dir / "tmp")
    assert not [p for p in files_under(d.cache_dir / "blobs")]
