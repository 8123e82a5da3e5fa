"""The engine through a real daemon: setup --stream, run, demo, and bitwise-equal logits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from tests.exactness import assert_bitwise, run_logits
from tests.harness import CACHECD, TINY_REPO, run_cli

PROMPT = "Experts stream from the hub into a verified cache, layer after layer."


def test_setup_is_idempotent_and_installs_no_expert(installed, hub, tiny_manifest, tiny_manifest_path):
    local = installed.base / "models" / TINY_REPO / tiny_manifest.revision
    resident = local / "model-resident.safetensors"
    assert resident.exists()
    size = sum(f.stat().st_size for f in local.rglob("*.safetensors"))
    assert size < tiny_manifest.resident_bytes_total + 64 * 1024  # header only on top
    with installed.client() as c:
        assert c.stats()["store"]["entries"] == 0  # setup fetched no expert
    again = run_cli("setup", "--stream", TINY_REPO, "--endpoint", hub.url, "--socket",
                    str(installed.socket), "--manifest", str(tiny_manifest_path), "--models-dir",
                    str(installed.base / "models")).stdout
    assert "fetched 0 B now" in again and "started a daemon" not in again


def test_streamed_logits_are_bitwise_resident_cold_and_warm(installed, tiny_dir):
    from mlx_lm.utils import load_model

    from cachecd_engine.run import load

    reference, _ = load_model(tiny_dir)
    model, tokenizer = load(TINY_REPO, installed.socket, ram_bytes=0)  # every layer asks the daemon
    prompt = tokenizer.encode(PROMPT)
    assert len(prompt) >= 16  # x top-4 >= 64 routed rows: mlx-lm's sorted gather path
    ref, toks = run_logits(reference, prompt)
    cold, _ = run_logits(model, prompt, toks)
    assert_bitwise(ref, cold)
    with installed.client() as c:
        after_cold = c.stats()["counters"]
    assert after_cold["fetched_experts"] > 0
    warm, _ = run_logits(model, prompt, toks)
    assert_bitwise(ref, warm)
    with installed.client() as c:
        after_warm = c.stats()["counters"]
    assert after_warm["fetched_experts"] == after_cold["fetched_experts"]  # all hits
    assert after_warm["expert_hits"] > after_cold.get("expert_hits", 0)
    model.bank.source.close()


def test_run_json_streams_tokens_with_stats(installed):
    out = run_cli("run", "--model", TINY_REPO, "--prompt", PROMPT, "--max-new", "8", "--socket",
                  str(installed.socket), "--json", "--no-prefetch").stdout
    data = json.loads(out)
    assert len(data["tokens"]) == 8
    first = data["per_token"][0]
    assert first["experts_routed"] > 0 and first["source_hits"] > 0 and first["source_bytes"] > 0
    # The cache was cold: the prefill's experts were fetched upstream, and counted as such
    # (without read-ahead, whose hints let the daemon fetch some before they are asked for).
    assert first["fetched_upstream"] == first["source_hits"]
    text = run_cli("run", "--model", TINY_REPO, "--prompt", PROMPT, "--max-new", "8", "--socket",
                   str(installed.socket)).stdout
    assert text.strip() and text.strip() == data["text"].strip()


def test_run_within_a_small_expert_memory_bound(installed):
    """--expert-memory small enough that every call runs in groups: the same text; too small
    for two experts: a one-line error that says what to raise."""
    args = ["run", "--model", TINY_REPO, "--prompt", PROMPT, "--max-new", "6", "--socket",
            str(installed.socket)]
    whole = json.loads(run_cli(*args, "--json").stdout)
    grouped = json.loads(run_cli(*args, "--json", "--expert-memory", "40KB").stdout)
    assert grouped["tokens"] == whole["tokens"]
    assert grouped["per_token"][0]["groups"] > grouped["per_token"][0]["layer_calls"]
    bad = run_cli(*args, "--expert-memory", "1KB", check=False)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "cannot hold two experts" in bad.stderr and "--expert-memory" in bad.stderr


def test_demo_runs_end_to_end():
    """In $TMPDIR (kept with --keep, where it says), saying that the weights are random; nothing
    left in the user's ~/.config/cachecd (setup's record of its settings is the demo's own)."""
    from tests.harness import short_tmp

    tmp = short_tmp("cdtmp")
    home = tmp / "home"
    home.mkdir()
    # The user's own config location: no CACHECD_CONFIG (the suite's) nor XDG_CONFIG_HOME.
    env = {k: v for k, v in os.environ.items() if k not in ("CACHECD_CONFIG", "XDG_CONFIG_HOME")}
    proc = subprocess.run([*CACHECD, "demo", "--max-new", "8", "--keep"], capture_output=True,
                          text=True, timeout=600, env={**env, "TMPDIR": str(tmp), "HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert not (home / ".config").exists(), list((home / ".config").rglob("*"))
    lines = [line for line in out.splitlines() if line.strip()]
    kept = Path(lines[-1].removeprefix("kept "))
    assert kept.parent == tmp and kept.name.startswith("cachecd-demo-"), out
    summary = json.loads(lines[-2])
    assert 0 < summary["experts_cached"] <= summary["experts_total"]
    assert "cachecd run" in out and "what the daemon fetched" in out
    assert "weights are random numbers, so its text is gibberish" in out
    shutil.rmtree(tmp, ignore_errors=True)
