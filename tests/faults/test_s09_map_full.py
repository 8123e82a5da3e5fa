"""Scenario 9: the LMDB map starts at 64 KiB (CACHECD_MAP_SIZE) and fills under thousands of rows.
The writer grows it (x2) and retries. The first growth is held at the named crash point
``during_map_growth`` (the map grown, the txn that needed it not retried yet: CACHECD_PAUSE_AT)
and the daemon is killed there, so the kill lands during the growth every run (the log shows
the growth begun and not finished); the index reopens cleanly (fsck exit 0), and the restarted
daemon grows it again to hold every row. Each expert read through the data path adds access
rows, so the index holds ~3 rows per expert."""

from __future__ import annotations

import re
import threading
import time

import lmdb
import pytest

from cachecd.errors import CachecdError
from cachecd.store.index import INDEX_DIRNAME
from tests.faults.figures import FIGURES
from tests.faults.support import FaultDaemon, Model, fetch_verified, fsck_exit_code

ENV = {"CACHECD_MAP_SIZE": "64KiB"}


@pytest.fixture(scope="module")
def many(fault_root) -> Model:  # type: ignore[no-untyped-def]
    from tests.faults.support import build_model

    return build_model(fault_root, "faults/many", experts=256, layers=6, expert_hidden=32,
                       moe_intermediate=32, shard_bytes=1 << 20)


def _read_all(d: FaultDaemon, model: Model) -> None:
    with d.client(timeout=120) as c:
        for layer in model.layers:
            fetch_verified(c, model, layer, list(range(model.manifest.experts_per_layer)))


def _growths(d: FaultDaemon, done: str = "grown") -> list[int]:
    return [int(n) for n in re.findall(rf"event=index_map_{done} old=\d+ new=(\d+)", d.log())]


def _rows(cache_dir) -> int:  # type: ignore[no-untyped-def]
    """Rows in every named database of the index (read-only, after the daemon stopped)."""
    env = lmdb.open(str(cache_dir / INDEX_DIRNAME), readonly=True, lock=False, max_dbs=8)
    try:
        with env.begin() as txn:
            names = [k for k, _ in txn.cursor()]
            return sum(txn.stat(env.open_db(n, txn=txn, create=False))["entries"] for n in names)
    finally:
        env.close()


def test_map_grows_and_a_kill_during_growth_reopens_cleanly(many: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(many)
    d = pool.daemon(hub, [many], env={**ENV, "CACHECD_PAUSE_AT": "during_map_growth:120"})
    initial = d.status()["store"]["index_map_size"]
    assert initial == 64 * 1024

    def load() -> None:
        try:
            _read_all(d, many)
        except CachecdError:
            pass  # the kill below ends it

    loader = threading.Thread(target=load)
    loader.start()
    deadline = time.monotonic() + 120
    while not _growths(d, "growing") and time.monotonic() < deadline and d.running():
        time.sleep(0.002)
    assert _growths(d, "growing"), "the 64 KiB map never filled"
    d.kill9()  # the growth is held at its crash point for 120 s: the kill lands inside it
    loader.join(120)
    begun, finished = _growths(d, "growing"), _growths(d, "grown")
    assert len(begun) == 1 and not finished, (begun, finished)
    FIGURES.set("s09.initial_map_bytes", initial)
    FIGURES.add("s09.kills_during_growth", len(begun) - len(finished))
    assert fsck_exit_code(d.cache_dir) == 0
    d.set_env(ENV)
    d.start()  # reopens with the same 64 KiB setting, no pause; LMDB keeps the grown size
    _read_all(d, many)
    status = d.status()["store"]
    assert status["entries"] == many.manifest.n_experts
    grown = _growths(d)
    FIGURES.set("s09.map_growths", len(grown))
    FIGURES.set("s09.final_map_bytes", status["index_map_size"])
    FIGURES.set("s09.experts_indexed", status["entries"])
    assert status["index_map_size"] > 64 * 1024 and len(grown) >= 2
    assert d.stop() == 0
    rows = _rows(d.cache_dir)
    FIGURES.set("s09.index_rows", rows)
    assert rows >= 2 * many.manifest.n_experts
