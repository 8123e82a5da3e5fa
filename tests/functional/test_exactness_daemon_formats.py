"""fp32 (tiny K3), int4 and fp8 (tiny K2) through a real daemon: every logit bitwise mlx-lm's.

Each checkpoint is served by `cachecd hub serve`, its manifest built by `cachecd manifest build`,
and installed by `cachecd setup --stream` into a daemon on a Unix socket under a short /tmp dir.
The engine reads every routed expert through that daemon (read-ahead on); the
reference is ``mlx_lm.utils.load_model`` on the full checkpoint. Cold cache (fetched upstream),
then warm (hits only), then warm with the RAM tier on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.exactness import assert_bitwise, formats_served, run_logits
from tests.harness import DaemonProcess, HubProcess, run_cli

PROMPT = "Every routed expert streams through the daemon, bit for bit, cold and warm."
REPOS = {
    "fp32": "cachecd/tiny-k3-fp32",
    "int4": "cachecd/tiny-k2-int4",
    "fp8": "cachecd/tiny-k2-fp8",
}
SORTED_GATHER_ROWS = 64  # mlx-lm's gather_qmm/gather_mm sort the rows from this many on


@pytest.fixture(scope="module")
def formats_hub() -> Iterator[tuple[Path, HubProcess]]:
    """One `cachecd hub serve` over the checkpoints."""
    with formats_served("cdfh", REPOS) as served:
        yield served


@dataclass
class Served:
    fmt: str
    repo: str
    full: Path
    daemon: DaemonProcess
    top_k: int


@pytest.fixture(scope="module", params=sorted(REPOS))
def served(
    request: pytest.FixtureRequest, formats_hub: tuple[Path, HubProcess]
) -> Iterator[Served]:
    root, hub = formats_hub
    repo = REPOS[request.param]
    daemon = DaemonProcess(hub.url).start()  # no model yet: setup registers it
    try:
        manifest = daemon.base / "model.manifest"
        run_cli(
            "manifest", "build", f"{repo}@main", "--endpoint", hub.url, "--output", str(manifest)
        )
        out = run_cli(
            "setup",
            "--stream",
            repo,
            "--endpoint",
            hub.url,
            "--socket",
            str(daemon.socket),
            "--models-dir",
            str(daemon.base / "models"),
            "--manifest",
            str(manifest),
        ).stdout
        assert "installed" in out and "started a daemon" not in out, out
        yield Served(request.param, repo, root / repo, daemon, _top_k(root / repo))
    finally:
        daemon.cleanup()


def _top_k(full: Path) -> int:
    config = json.loads((full / "config.json").read_text())
    text = config.get("text_config", config)  # K3 nests its text model; K2 is flat
    return int(text.get("num_experts_per_tok") or text["num_experts_per_token"])


def _counters(served: Served) -> dict[str, int]:
    """The daemon's counters once read-ahead hints have settled (they fetch in the background)."""
    with served.daemon.client() as c:
        last = c.stats()["counters"]
        for _ in range(200):
            time.sleep(0.05)
            now = c.stats()["counters"]
            if now.get("fetched_experts", 0) == last.get("fetched_experts", 0):
                return now
            last = now
    raise AssertionError(f"upstream fetches did not settle: {last}")


def _close(model: Any) -> None:
    if model is not None:
        model.bank.close()
        model.bank.source.close()


def test_logits_bitwise_through_daemon_cold_warm_small_and_big_pool(served: Served) -> None:
    from mlx_lm.utils import load_model

    from cachecd.manifest.manifest import Manifest
    from cachecd_engine.formats import StackLayout, quant_spec
    from cachecd_engine.pool.arrays import PoolMemory
    from cachecd_engine.run import load

    with served.daemon.client() as c:
        assert c.stats()["store"]["entries"] == 0  # setup fetched no expert: the cache is cold
    reference, _ = load_model(served.full)
    streamed = ram = None
    try:
        # A pool of three decode calls' experts: far smaller than what the tokens route to.
        with served.daemon.client() as c:
            m = Manifest.from_bytes(c.manifest_bytes(served.repo), served.repo)
        layout = StackLayout.of(m.expert(m.moe_layers[0], 0))
        small = 3 * served.top_k * PoolMemory.slot_nbytes(quant_spec(m.quant_format), layout)
        streamed, tokenizer = load(served.repo, served.daemon.socket, ram_bytes=small,
                                   prefetch=True)
        prompt = tokenizer.encode(PROMPT)
        assert len(prompt) * served.top_k >= SORTED_GATHER_ROWS
        ref, toks = run_logits(reference, prompt)
        # Non-trivial: finite, and every step's last row differs (a wrong byte would show).
        assert all(np.isfinite(a).all() for a in ref)
        assert len({a[0, -1].tobytes() for a in ref}) == len(ref)

        cold, _ = run_logits(streamed, prompt, toks)
        assert_bitwise(ref, cold)
        after_cold = _counters(served)
        assert after_cold["fetched_experts"] > 0 and after_cold["expert_misses"] > 0
        assert streamed.bank.table.counters.evicted > 0
        assert after_cold["prefetch_hints"] > 0  # read-ahead was on, and changed no logit

        warm, _ = run_logits(streamed, prompt, toks)
        assert_bitwise(ref, warm)
        after_warm = _counters(served)
        assert after_warm["fetched_experts"] == after_cold["fetched_experts"]  # no upstream fetch
        assert after_warm["expert_misses"] == after_cold["expert_misses"]
        assert after_warm["expert_hits"] > after_cold.get("expert_hits", 0)
        assert streamed.bank.stats.staged_hits > 0  # decode steps used experts read ahead

        ram, _ = load(served.repo, served.daemon.socket, ram_bytes=1 << 30, prefetch=True)
        tiered, _ = run_logits(ram, prompt, toks)
        assert_bitwise(ref, tiered)
        after_ram = _counters(served)
        assert after_ram["fetched_experts"] == after_cold["fetched_experts"]
        assert after_ram["expert_misses"] == after_cold["expert_misses"]
        stats = ram.bank.stats
        assert stats.ram_hits > 0 and stats.source_hits > 0  # the pool and the daemon served
    finally:
        _close(streamed)
        _close(ram)


def test_cachecd_run_prefills_layer_by_layer_bitwise(served: Served) -> None:
    """`cachecd run` (a subprocess through the daemon): prompts of 1, 2 and 5 prefill steps at
    two step sizes, run layer by layer; every token and its logprob bitwise resident mlx-lm's
    ``stream_generate`` at the same step size."""
    from mlx_lm.utils import load_model, load_tokenizer

    from tests.exactness import (
        PREFILL_SIZES,
        PREFILL_STEPS,
        cachecd_run_logprobs,
        mlx_lm_logprobs,
        text_of,
    )

    reference, _ = load_model(served.full)
    tokenizer = load_tokenizer(served.full)
    for step in PREFILL_SIZES:
        for steps in PREFILL_STEPS:
            text = text_of(tokenizer, steps * step + 1)
            want = mlx_lm_logprobs(reference, tokenizer, text, step, 4)
            got = cachecd_run_logprobs(served.daemon.socket, served.repo, text, step, 4)
            assert got == want, f"step {step} x {steps}"
