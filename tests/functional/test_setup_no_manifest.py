"""`cachecd setup --stream ORG/NAME` with no manifest at all, against `cachecd hub serve` keeping its
files in Xet (as the Hub does), behind a proxy that counts every byte read of it: the expert map
from the shards' headers proven through Xet, the small files checked against the commit's tree,
each resident tensor and each expert proven on its first fetch. Then the engine through the daemon
gives logits bitwise those of mlx-lm loading the checkpoint whole, and the hub served no more than
the resident model, the experts routed, the headers and small files, and what their proofs cost
(docs/streaming.md)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cachecd.manifest.manifest import Manifest
from tests.exactness import assert_bitwise, run_logits
from tests.fakes.counting_proxy import CountingProxy
from tests.harness import HubProcess, run_cli, short_tmp, stop_daemon

REPO = "someone/tiny-moe"  # no manifest ships for it
PROMPT = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61]


@dataclass
class NoManifest:
    base: Path
    socket: Path
    proxy: CountingProxy
    out: str

    def setup(self, *extra: str) -> str:
        return run_cli("setup", "--stream", REPO, "--endpoint", self.proxy.url, "--socket",
                       str(self.socket), "--cache-dir", str(self.base / "cache"), "--models-dir",
                       str(self.base / "models"), *extra).stdout


@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    """A small model whose experts (208 KiB) are a few of Xet's chunks each, as a real model's
    are many (K3's: 17.5 MB): what a proof's window adds to a range is then its own cost, not
    the model's size over again."""
    from cachecd.testbed.tiny_model import write_tiny_model

    root = short_tmp("cdnmhub")
    write_tiny_model(root / REPO, experts=8, top_k=2, layers=3, expert_hidden=256,
                     moe_intermediate=512, shard_bytes=2 << 20)
    yield root / REPO
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def installed(model_dir: Path) -> Iterator[NoManifest]:
    hub = HubProcess(model_dir.parent.parent)
    proxy = CountingProxy(hub.url).start()
    base = short_tmp("cdnm")
    inst = NoManifest(base, base / "run" / "s.sock", proxy, "")
    try:
        inst.out = inst.setup()
        yield inst
    finally:
        try:
            stop_daemon(inst.socket)
        except Exception:  # noqa: BLE001 - a setup that failed started none
            pass
        proxy.stop()
        hub.stop()


def test_setup_needs_no_manifest_and_runs_bitwise(installed: NoManifest, model_dir: Path) -> None:
    from mlx_lm.utils import load_model

    from cachecd_engine.run import load

    assert "no manifest:" in installed.out and "proven through Xet" in installed.out
    assert "installed" in installed.out
    reference, _ = load_model(model_dir)
    model, _ = load(REPO, installed.socket, ram_bytes=0)  # every layer asks the daemon
    try:
        ref, toks = run_logits(reference, PROMPT, steps=4)
        got, _ = run_logits(model, PROMPT, toks, steps=4)
        assert_bitwise(ref, got)
        # The engine checks what it reads off the disk (rot) against the digests the daemon
        # learnt from proven bytes, asked for as it reads: a later token's reads were checked.
        m = model.bank.source.manifest
        checked = [r for r in range(len(m.digests)) if not m.unlearnt(r)]
        assert checked and model.bank.source.client.checksum_mismatches == 0
        engine_learnt = {(int(m.layer_ids[r]), int(m.expert_ids[r])): m.digests[r].tobytes()
                         for r in checked}
    finally:
        model.bank.source.close()
    from cachecd_client import Client

    with Client(installed.socket) as c:
        stats = c.stats()
    learnt = stats["counters"]["learnt_experts"]
    assert learnt > 0
    # Each digest the daemon learnt (and recorded) is the one a full pass gives that expert.
    built = _built(installed, model_dir)
    record = next((installed.base / "models" / "manifests").glob("*.learnt")).read_text()
    rows = [line.split() for line in record.splitlines()]
    assert len(rows) == learnt
    routed = [built.expert(int(r[0]), int(r[1])) for r in rows]
    assert [r[3] for r in rows] == [e.digest_hex for e in routed]
    assert all(built.expert(*k).xxh3 == d for k, d in engine_learnt.items())
    # What the hub served: the resident model, the routed experts, the headers and small files,
    # and the proofs' answers, within 10% (each window's widening is the rest).
    seen = installed.proxy.seen
    total = sum(s.nbytes for s in seen)
    proofs = sum(s.nbytes for s in seen if "/file-chunk-hashes/" in s.path
                 or "/reconstructions/" in s.path)
    small = sum(f.size for f in built.files.values() if not f.name.endswith(".safetensors"))
    heads = sum(8 + f.header_len for f in built.files.values() if f.header_len)
    resident = sum(t.nbytes for t in built.resident)
    need = resident + sum(e.nbytes for e in routed) + proofs + small + heads
    print(f"hub served {total} bytes for {need}: resident {resident}, {len(routed)} experts "
          f"{sum(e.nbytes for e in routed)}, proofs {proofs}, small files {small}, headers "
          f"{heads}; the whole model {sum(f.size for f in built.files.values())}")
    assert total <= 1.1 * need


def _built(installed: NoManifest, model_dir: Path) -> Manifest:
    out = installed.base / "built.manifest"  # the hub's own bytes, not through the proxy
    run_cli("manifest", "build", f"{REPO}@main", "--endpoint", installed.proxy.target,
            "--output", str(out))
    return Manifest.load(out)
