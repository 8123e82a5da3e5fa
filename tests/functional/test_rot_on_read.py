"""Rot is never served: a blob that rots in place under a running engine is caught as it is
read (every expert's bytes hashed on the reader threads against the manifest's xxh3-128),
quarantined by the daemon and fetched again, and the logits stay bitwise the resident model's.
The daemon quarantines only what its own hash fails: a report about a good blob moves nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from cachecd.errors import ChecksumMismatch
from tests.exactness import assert_bitwise, run_logits
from tests.harness import TINY_REPO

PROMPT = "Experts stream from the hub into a verified cache, layer after layer."


def _blob(cache: Path, digest: str) -> Path:
    return cache / "blobs" / digest[:2] / digest


def _flip_in_place(path: Path, offset: int) -> None:
    """Same inode, same length, through the page cache the daemon's held fds read."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x5A]), offset)
    finally:
        os.close(fd)


def test_a_blob_rotting_under_a_running_engine_is_caught_read_again_and_quarantined(
        installed, tiny_dir, tiny_manifest) -> None:  # type: ignore[no-untyped-def]
    from mlx_lm.utils import load_model

    from cachecd_engine.run import load

    reference, _ = load_model(tiny_dir)
    model, tokenizer = load(TINY_REPO, installed.socket, ram_bytes=0)
    prompt = tokenizer.encode(PROMPT)
    ref, toks = run_logits(reference, prompt)
    cold, _ = run_logits(model, prompt, toks)  # fetches what the prompt routes to
    assert_bitwise(ref, cold)
    cache = installed.base / "cache"
    m = tiny_manifest
    cached = [(layer, e) for layer in m.moe_layers for e in range(m.experts_per_layer)
              if _blob(cache, m.expert(layer, e).digest_hex).exists()]
    layer, expert = cached[0]  # the prompt routes to it: the same prompt routes to it again
    entry = m.expert(layer, expert)
    rotten = _blob(cache, entry.digest_hex)
    client = model.bank.source.client
    with installed.client() as c:
        before = c.stats()
    _flip_in_place(rotten, entry.nbytes // 2)
    for moe in m.moe_layers:  # out of the pool: the next pass reads every expert again
        model.bank.drop(moe, list(range(m.experts_per_layer)))
    again, _ = run_logits(model, prompt, toks)
    assert_bitwise(ref, again)
    assert client.checksum_mismatches == 1
    quarantined = [p.name for p in (cache / "quarantine").iterdir()]
    assert any(name.startswith(entry.digest_hex) for name in quarantined), quarantined
    assert xxhash.xxh3_128(rotten.read_bytes()).digest() == entry.xxh3  # fetched again
    with installed.client() as c:
        after = c.stats()
        # A report about a good blob is checked, not believed: nothing moves.
        good = cached[1]
        assert c.recheck(TINY_REPO, good[0], [good[1]]) == {good[1]: "good"}
        assert c.recheck(TINY_REPO, layer, [expert]) == {expert: "good"}  # the refetched one
        last = c.stats()
    assert after["store"]["bit_rot_on_read"] == 1 and after["store"]["quarantined"] == 1
    assert after["counters"]["fetched_experts"] == before["counters"]["fetched_experts"] + 1
    assert last["store"]["quarantined"] == 1 and last["store"]["rechecked_good"] == 2
    assert _blob(cache, m.expert(*good).digest_hex).exists()
    model.bank.close()
    model.bank.source.close()


def test_a_reader_whose_bytes_stay_wrong_gets_checksum_mismatch_and_evicts_nothing(
        installed, tiny_manifest) -> None:  # type: ignore[no-untyped-def]
    """A digest the blob can never match (the reader's bytes, not the disk's, are wrong): the
    daemon's own hash finds the blob good and keeps it, the read is tried once more, then
    fails with ``checksum_mismatch``; the other expert of the call is read and kept."""
    m, layer, ids = tiny_manifest, tiny_manifest.moe_layers[0], [0, 1]
    entries = [m.expert(layer, e) for e in ids]
    bufs = [np.zeros(e.nbytes, np.uint8) for e in entries]
    with installed.client() as c:
        c.experts_into(TINY_REPO, layer, ids, [memoryview(b) for b in bufs],
                       digests=[e.xxh3 for e in entries])  # fetched, and checked
        with pytest.raises(ChecksumMismatch, match="twice") as err:
            c.experts_into(TINY_REPO, layer, ids, [memoryview(b) for b in bufs],
                           digests=[entries[0].xxh3, bytes(16)])
        store = c.stats()["store"]
        assert c.checksum_mismatches == 1
    assert "experts [1]" in str(err.value) and "good" in str(err.value)
    assert xxhash.xxh3_128(bufs[0]).digest() == entries[0].xxh3
    assert store["quarantined"] == 0 and store["rechecked_good"] == 1
    assert store["bit_rot_on_read"] == 0
    assert all(_blob(installed.base / "cache", e.digest_hex).exists() for e in entries)
