"""Read-ahead never holds up a demand read: the client reads guesses (``experts_into(...,
ahead=True)``, what ``DaemonSource.read_ahead_into`` and the pool's read-ahead use) on threads
of their own, so a demand read of the same client is not queued behind them."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from cachecd.manifest.manifest import Manifest
from cachecd_client import Client, transport
from tests.harness import TINY_REPO, DaemonProcess


def _targets(manifest: Manifest, layer: int, ids: list[int]) -> list[memoryview]:
    return [memoryview(bytearray(manifest.expert(layer, e).nbytes)) for e in ids]


def test_a_demand_read_is_not_queued_behind_read_ahead(daemon: DaemonProcess,
                                                        tiny_manifest: Manifest,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiny model's experts are small enough to be read inline on the caller's thread
    # (reads under 256 KiB skip the pools): every read goes through its pool here, as K3's do.
    monkeypatch.setattr(transport, "_MIN_JOB", 1)
    layer = tiny_manifest.moe_layers[0]
    with Client(daemon.socket, readers=2) as client:
        client.experts_into(TINY_REPO, layer, [0, 1, 2, 3], _targets(tiny_manifest, layer,
                                                                     [0, 1, 2, 3]))  # cached
        gate = threading.Event()
        ahead_pool = client._ahead_pool
        busy = [ahead_pool.submit(gate.wait) for _ in range(ahead_pool._max_workers)]
        try:
            with ThreadPoolExecutor(1) as side:  # a read-ahead of guesses, stuck behind them
                guess = side.submit(client.experts_into, TINY_REPO, layer, [0, 1],
                                    _targets(tiny_manifest, layer, [0, 1]), ahead=True)
                demand = _targets(tiny_manifest, layer, [2, 3])
                sizes = client.experts_into(TINY_REPO, layer, [2, 3], demand)  # must not wait
                assert sizes == [t.nbytes for t in demand] and any(demand[0])
                assert not guess.done()  # the read-ahead was still queued all along
                gate.set()
                assert guess.result(timeout=60) == [tiny_manifest.expert(layer, e).nbytes
                                                    for e in (0, 1)]
        finally:
            gate.set()  # else the pool's threads would wait for ever (and the process with them)
        for f in busy:
            f.result()
