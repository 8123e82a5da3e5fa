"""`cachecd plan` as a user runs it (no --compute-ms, no trace), against `cachecd run` on the same
machine, and for a model that is not installed (the local hub as the Hub, no daemon).

The model: a tiny K3 whose config routes 6 experts a token (kimi_k3's own is 16) and whose head
(32,768 tokens) costs more than its routed experts, as a held-out model's attention and head
can: a plan that counts only the routed experts, or the model type's top-k, is far off it.
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import HubProcess, LoggedHub, run_cli, short_tmp, stop_daemon

REPO = "me/wide-k3"
TOP_K = 6


@pytest.fixture(scope="module")
def wide_hub() -> Iterator[LoggedHub]:
    from cachecd.testbed.tiny_model import write_tiny_model

    root = short_tmp("cdwide")
    write_tiny_model(root / REPO, top_k=TOP_K, vocab_size=32768, hidden=256)
    proc = LoggedHub(root)
    yield proc
    proc.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def installed(wide_hub: LoggedHub) -> Iterator[Path]:
    """``setup --stream`` (building the manifest), one untimed run to put the experts it routes
    to on disk, and a doctor's JSON of the cache dir (the doctor is not what is checked here:
    a small file keeps it quick). Yields the base dir."""
    base = short_tmp("cdwi")
    sock = base / "s.sock"
    run_cli("setup", "--stream", REPO, "--build-manifest", "--endpoint", wide_hub.url, "--socket",
            str(sock), "--cache-dir", str(base / "cache"), "--models-dir", str(base / "models"),
            timeout=300)
    _run(sock)
    doctor = run_cli("doctor", "--cache-dir", str(base / "cache"), "--size", "16MiB",
                     "--block", "64KiB", "--socket", str(sock), "--json").stdout
    (base / "doctor.json").write_text(doctor)
    yield base
    stop_daemon(sock)
    shutil.rmtree(base, ignore_errors=True)


def _run(sock: Path) -> float:
    out = run_cli("run", "--model", REPO, "--socket", str(sock), "--prompt", "Hello there",
                  "--max-tokens", "64", "--json", timeout=300).stdout
    return float(json.loads(out)["generation_tps"])


def _plan(*args: str) -> dict:
    return json.loads(run_cli("plan", "--model", REPO, *args, "--json", timeout=300).stdout)


def test_the_default_plan_is_within_reach_of_a_short_run(installed: Path) -> None:
    """The plan's tok/s for the run's setting (every expert on disk, the default pool) against
    `cachecd run`'s decode tok/s, measured in turn (a shared machine's slow stretch hits both):
    the ratio of the medians within a wide band. Before, the plan counted top-16 routed experts
    and nothing else: 5.5x a held-out model's run."""
    sock = installed / "s.sock"
    runs, plans = [], []
    for _ in range(3):
        runs.append(_run(sock))
        plan = _plan("--socket", str(sock), "--doctor", str(installed / "doctor.json"))
        whole = plan["budgets"][-1]
        assert whole["budget"] == plan["model"]["expert_bytes_total"]
        plans.append(whole["tok_s_warm"])
    ratio = statistics.median(runs) / statistics.median(plans)
    assert 0.5 <= ratio <= 2.0, (runs, plans, plan["compute"])
    m = plan["model"]
    assert (m["top_k"], m["top_k_source"], m["config"]) == (TOP_K, "config.json", True)
    assert plan["compute"]["source"].startswith("measured: a decode token of the model built")


def test_a_model_not_installed_is_planned_from_its_config_and_headers(
        wide_hub: LoggedHub, installed: Path) -> None:
    """No daemon at the socket it asks: the Hub's config.json and shard headers give the same
    experts, bytes and top-k as the manifest setup built, reading only the headers (every shard
    GET a 206, a small share of the shards' bytes)."""
    hub = wide_hub
    mark = hub.mark()
    plan = _plan("--endpoint", hub.url, "--socket", str(installed / "nobody.sock"),
                 "--doctor", str(installed / "doctor.json"))
    built = _plan("--socket", str(installed / "s.sock"), "--doctor",
                  str(installed / "doctor.json"), "--compute-ms", "1")["model"]
    m = plan["model"]
    assert m["origin"].startswith("not installed") and m["config"] is True
    for key in ("revision", "moe_layers", "experts_per_layer", "top_k", "expert_bytes_total",
                "resident_bytes", "bytes_per_token", "quant_format"):
        assert m[key] == built[key], key
    assert (m["moe_layers"], m["experts_per_layer"], m["top_k"]) == (5, 32, TOP_K)
    assert m["fetched_bytes"] < 0.02 * m["shard_bytes"], m
    shard_gets = [r for r in hub.requests(mark)
                  if r[0] == "GET" and r[1].endswith(".safetensors")]
    assert shard_gets and all(status == 206 for _, _, status in shard_gets), shard_gets
    assert plan["recommended"]["tok_s_warm"] > 0
    table = run_cli("plan", "--model", REPO, "--endpoint", hub.url, "--socket",
                    str(installed / "nobody.sock"), "--doctor",
                    str(installed / "doctor.json"), timeout=300).stdout
    assert "not installed" in table and "top-6 (config.json)" in table, table


def test_a_shipped_manifest_takes_its_top_k_from_the_config_it_pins(
        hub: HubProcess, installed: Path) -> None:
    """The tiny K3's manifest ships with cachecd, without its config.json: the plan reads the
    config the manifest pins from the Hub (top-4), where the model type's table says 16."""
    plan = json.loads(run_cli(
        "plan", "--model", "cachecd/tiny-k3", "--endpoint", hub.url, "--socket",
        str(installed / "nobody.sock"), "--doctor", str(installed / "doctor.json"),
        "--call-ms", "0", "0", "--json", timeout=300).stdout)
    m = plan["model"]
    assert (m["top_k"], m["top_k_source"], m["origin"]) == (
        4, "config.json", "manifest shipped with cachecd")
    assert plan["compute"]["source"].startswith("measured: a decode token of the model built")
