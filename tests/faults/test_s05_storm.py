"""Scenario 5: 429 and 5xx storms. After a 429 with Retry-After: 2 no request reaches the host for
2 s (FakeHub arrival times); under 30 % 503s the number of CDN GETs in flight never passes
--max-parallel; 401/403/404 are answered with their typed error after one request."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cachecd.errors import CachecdError, Gated, NotFound, Unauthorized, UpstreamError
from tests.fakes.fake_hub import Faults
from tests.faults.figures import FIGURES
from tests.faults.support import Model, fetch_verified

LIMIT = 4


@pytest.fixture(scope="module")
def setup(small: Model, module_pool):  # type: ignore[no-untyped-def]
    hub = module_pool.hub(small)
    return hub, module_pool.daemon(hub, [small], args=["--max-parallel", str(LIMIT)])


@pytest.fixture
def fresh(setup):  # type: ignore[no-untyped-def]
    hub, d = setup
    hub.faults = Faults()
    hub.clear_records()
    return setup


def _file_requests(hub, kind: str, file: str) -> int:  # type: ignore[no-untyped-def]
    return sum(1 for r in hub.records if r.kind == kind and r.path.endswith("/" + file))


@pytest.mark.parametrize(("status", "error"), [(401, Unauthorized), (403, Gated), (404, NotFound)])
def test_resolve_refusals_are_not_retried(small: Model, fresh, status: int, error: type) -> None:  # type: ignore[no-untyped-def]
    hub, d = fresh
    layer = small.layers[0]
    entry = small.entry(layer, 0)
    hub.faults.resolve_status_script = [status]
    with d.client() as c, pytest.raises(error) as info:
        fetch_verified(c, small, layer, [0])
    assert not info.value.retryable
    assert _file_requests(hub, "resolve_head", entry.ranges[0].file) == 1
    FIGURES.add("s05.refusals_not_retried")


@pytest.mark.parametrize(("status", "error"), [(401, Unauthorized), (404, NotFound)])
def test_cdn_refusals_are_not_retried(small: Model, fresh, status: int, error: type) -> None:  # type: ignore[no-untyped-def]
    hub, d = fresh
    layer = small.layers[0]
    with d.client() as c:
        fetch_verified(c, small, layer, [1])  # the file's location is now resolved and cached
        hub.clear_records()
        hub.faults.status_script = [status]
        with pytest.raises(error):
            fetch_verified(c, small, layer, [2])
    assert hub.count("cdn_get") == 1
    FIGURES.add("s05.refusals_not_retried")


def test_no_request_within_retry_after_of_a_429(small: Model, fresh) -> None:  # type: ignore[no-untyped-def]
    hub, d = fresh
    hub.faults.status_script, hub.faults.retry_after = [429], "2"
    layer = small.layers[1]
    t_start = time.monotonic()

    def ask(ids: list[int]) -> None:
        with d.client() as c:
            fetch_verified(c, small, layer, ids)

    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(ask, [3])
        while not hub.records or hub.records[-1].status != 429:
            assert time.monotonic() - t_start < 10
            time.sleep(0.01)
        later = [pool.submit(ask, [e]) for e in (8, 13, 21)]  # arrive during the wait
        for f in (first, *later):
            f.result()
    t429 = next(r.t for r in hub.records if r.status == 429)
    after = [r.t - t429 for r in hub.records if r.t > t429]
    FIGURES.setting("s05.retry_after_s", int(hub.faults.retry_after))
    FIGURES.low("s05.first_request_after_429_s", round(min(after), 3))
    assert after and min(after) >= 2.0, after


def test_503_storm_keeps_in_flight_under_the_limit(small: Model, fresh) -> None:  # type: ignore[no-untyped-def]
    hub, d = fresh
    rng = random.Random(11)
    hub.faults.status_script = [503 if rng.random() < 0.3 else 0 for _ in range(400)]
    hub.faults.delay = 0.2  # answers take a while, so the daemon's requests overlap
    hub.peak_in_flight = 0
    layer = small.layers[2]
    retried = []
    lock = threading.Lock()

    def ask(ids: list[int]) -> None:
        with d.client() as c:
            try:
                fetch_verified(c, small, layer, ids)
            except UpstreamError as exc:  # retryable: a client asks again once
                assert exc.retryable
                with lock:
                    retried.append(exc)
                fetch_verified(c, small, layer, ids)

    batches = [list(range(i, i + 4)) for i in range(0, 32, 4)]
    with ThreadPoolExecutor(len(batches)) as pool:
        list(pool.map(ask, batches))
    served_503 = sum(1 for r in hub.records if r.status == 503)
    FIGURES.setting("s05.max_parallel", LIMIT)
    FIGURES.peak("s05.peak_in_flight", hub.peak_in_flight)
    FIGURES.set("s05.storm_503_answers", served_503)
    FIGURES.set("s05.storm_client_retries", len(retried))
    with d.client() as c:
        FIGURES.set("s05.daemon_upstream_retries", c.stats()["upstream"].get("retries", 0))
        assert c.stats()["upstream"]["peak_in_flight"] <= LIMIT
    assert served_503 >= 5
    assert 2 <= hub.peak_in_flight <= LIMIT  # overlapped, and never past the limit
    assert all(isinstance(e, CachecdError) for e in retried)
