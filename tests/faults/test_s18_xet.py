"""Scenario 18: the hub keeps its files in Xet (tests/fakes/fake_xet.py), so the daemon reads every
expert through the content store and proves each range against the hub's ``X-Xet-Hash`` before
it stores a byte. A real daemon subprocess on a real socket: the tiny model's logits bitwise the
resident model's through it; each tamper refused with nothing stored; each expiry recovered.
The global invariant (fsck clean, no temp, fds and tasks back) is checked at teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachecd.errors import CachecdError
from tests.fakes.fake_xet import XetFakeHub, XetFaults
from tests.faults.hubs import HubThread, RecordingHub
from tests.faults.support import FaultDaemon, Model, fetch_verified


class XetHub(XetFakeHub, RecordingHub):
    """The fault suite's hub, keeping its files in Xet, a xorb a chunk: every window (two
    chunks at least) spans two xorbs, so their terms can be swapped."""

    chunks_per_xorb = 1


@pytest.fixture(scope="module")
def xet(module_pool: Any, small: Model) -> Iterator[tuple[HubThread, FaultDaemon]]:
    t = module_pool.hub_thread(small, XetHub)
    # No proven chunk kept: each tamper must reach the chunks of its own expert's window.
    yield t, module_pool.daemon(t.hub, [small], env={"CACHECD_XET_KEEP_BYTES": "0"})


def _blobs(d: FaultDaemon, entry: Any) -> list[Path]:
    with d.client() as c:
        c.stats()  # waits for the commits of experts already answered
    return list((d.cache_dir / "blobs").rglob(f"*{entry.digest_hex}*"))


# One expert of its own per tamper: the daemon's cache is shared by the module.
TAMPERS = [("flip_xorb_byte", 0), ("bad_chunk_header", 1), ("proof_node", 2),
           ("proof_offset", 3), ("swap_terms", 4)]


@pytest.mark.parametrize(("fault", "expert"), TAMPERS)
def test_a_tampered_answer_is_refused_and_nothing_stored(
        xet: tuple[HubThread, FaultDaemon], small: Model, fault: str, expert: int) -> None:
    t, d = xet
    layer = small.layers[-1]
    entry = small.entry(layer, 20 + expert)
    t.hub.xet_faults = XetFaults(**{fault: True})
    try:
        with d.client() as c, pytest.raises(CachecdError) as caught:
            fetch_verified(c, small, layer, [entry.expert])
    finally:
        t.hub.xet_faults = XetFaults()
    assert caught.value.code in ("xet_proof_mismatch", "xet_invalid"), caught.value
    assert not _blobs(d, entry)
    with d.client() as c:  # the honest answer is taken once the tampering stops
        fetch_verified(c, small, layer, [entry.expert])
    assert _blobs(d, entry)


@pytest.mark.parametrize("fault", ["expire_urls", "expire_tokens_after_proof"])
def test_an_expiry_mid_read_is_recovered(xet: tuple[HubThread, FaultDaemon], small: Model,
                                         fault: str) -> None:
    t, d = xet
    layer = small.layers[-1]
    entry = small.entry(layer, 10 if fault == "expire_urls" else 11)
    mark = len(t.hub.records)
    t.hub.xet_faults = XetFaults(**{fault: 1})
    with d.client() as c:
        fetch_verified(c, small, layer, [entry.expert])
    kind = "xet_xorb" if fault == "expire_urls" else "xet_reconstruction"
    statuses = [r.status for r in t.hub.records[mark:] if r.kind == kind]
    assert statuses[0] in (401, 403) and statuses[-1] in (200, 206)


# Last: it reads every expert the prompt routes to (and more, ahead), which the tests above
# need uncached.
def test_logits_through_xet_are_bitwise_the_resident_models(
        xet: tuple[HubThread, FaultDaemon], small: Model, tmp_path: Path) -> None:
    from mlx_lm.utils import load_model

    from cachecd_client import Client
    from cachecd_engine.daemon_source import DaemonSource
    from cachecd_engine.loader import load
    from tests.exactness import assert_bitwise, make_resident_dir, run_logits

    t, d = xet
    reference, _ = load_model(small.folder)
    resident = make_resident_dir(small.folder, small.manifest, tmp_path / "resident")
    source = DaemonSource(Client(d.socket), small.repo, small.manifest)
    model, tokenizer = load(resident, source, ram_bytes=0)
    prompt = tokenizer.encode("Every expert read through Xet and proven, bit for bit.")
    ref, toks = run_logits(reference, prompt)
    got, _ = run_logits(model, prompt, toks)
    assert_bitwise(ref, got)
    source.close()
    hub = t.hub
    assert hub.count("cdn_get") == 0 and hub.count("xet_xorb") > 0  # no byte the LFS way
    with d.client() as c:
        info = c.stats()
    assert [m["route"] for m in info["models"]] == ["xet"]
    assert info["upstream"]["xet_windows"] > 0 and info["counters"]["fetched_experts"] > 0
