"""Scenario 6: many clients on one expert share one upstream fetch, its bytes or its error."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from cachecd import protocol
from cachecd.errors import CachecdError, NotFound
from tests.faults.figures import FIGURES
from tests.faults.support import Model, fetch_verified

CLIENTS = 64


def _gather(daemon, model: Model, layer: int, expert: int) -> list[object]:  # type: ignore[no-untyped-def]
    """CLIENTS concurrent requests, each on its own client, released together."""
    gate = threading.Barrier(CLIENTS)

    def one(_: int) -> object:
        with daemon.client(timeout=60) as c:
            c.health()  # connected before the gate, so the requests arrive together
            gate.wait()
            try:
                return fetch_verified(c, model, layer, [expert])[0]
            except CachecdError as exc:
                return exc

    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(one, range(CLIENTS)))


def _gets(hub, entry) -> int:  # type: ignore[no-untyped-def]
    first = entry.ranges[0]  # a split expert takes one GET per range
    want = f"bytes={first.start}-{first.end - 1}"
    return sum(1 for r in hub.records if r.kind == "cdn_get" and r.range == want
               and r.path.endswith("/" + first.file))


def test_64_clients_one_upstream_get_same_bytes(small: Model, hub_for, daemons) -> None:  # type: ignore[no-untyped-def]
    hub = hub_for(small)
    hub.faults.delay = 0.5
    d = daemons(hub, [small])
    layer = small.layers[0]
    results = _gather(d, small, layer, 5)
    assert all(isinstance(r, bytes) for r in results), [r for r in results if not isinstance(r, bytes)][:3]
    assert len(set(results)) == 1
    gets = _gets(hub, small.entry(layer, 5))
    assert gets == 1
    FIGURES.set("s06.clients_served_the_same_bytes", sum(1 for r in results if r == results[0]))
    FIGURES.set("s06.upstream_gets_for_64_clients", gets)


def test_64_clients_share_one_error_then_next_request_fetches_again(small: Model, hub_for, daemons) -> None:  # type: ignore[no-untyped-def]
    hub = hub_for(small)
    hub.faults.delay = 0.5
    hub.faults.status_script = [404]  # not retryable: one GET, one error for everyone
    d = daemons(hub, [small])
    layer, expert = small.layers[1], 9
    entry = small.entry(layer, expert)
    results = _gather(d, small, layer, expert)
    assert all(isinstance(r, NotFound) for r in results), {type(r).__name__ for r in results}
    assert len({r.message for r in results}) == 1  # type: ignore[union-attr]
    assert _gets(hub, entry) == 1
    FIGURES.set("s06.upstream_gets_for_64_failed", _gets(hub, entry))
    hub.faults.delay = 0.0
    with d.client() as c:
        fetch_verified(c, small, layer, [expert])
    assert _gets(hub, entry) == 2  # the failure was not cached


def test_first_caller_disconnecting_does_not_cancel_the_fetch(small: Model, hub_for, daemons) -> None:  # type: ignore[no-untyped-def]
    import socket

    hub = hub_for(small)
    hub.faults.delay = 1.0
    d = daemons(hub, [small])
    layer, expert = small.layers[2], 17
    entry = small.entry(layer, expert)
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(d.socket) + ".data")
    s.sendall(protocol.encode({"op": "experts", "model": small.repo, "layer": layer, "ids": [expert]}))
    deadline = time.monotonic() + 10
    while _gets(hub, entry) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    s.close()  # the only caller leaves while the upstream GET is in flight
    assert _gets(hub, entry) == 1
    deadline = time.monotonic() + 20
    while d.status()["store"]["entries"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    completed = d.status()["store"]["entries"]
    assert completed == 1, "the abandoned fetch did not complete"
    with d.client() as c:
        fetch_verified(c, small, layer, [expert])
    assert _gets(hub, entry) == 1  # a hit: the shielded fetch had finished
    FIGURES.set("s06.abandoned_fetch_completed", completed)  # experts cached after the caller left
    FIGURES.set("s06.upstream_gets_for_the_abandoned_expert", _gets(hub, entry))

