"""`cachecd plan` run as a user runs it: on the tiny model and a K3-shaped manifest, from a
doctor's JSON, with flat routing and from a trace; the JSON's figures agree with each other and
with the engine's default pool; the PNG is a PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cachecd import constants
from tests.harness import run_cli

TINY_REPO = "cachecd/tiny-k3"
ROOT = Path(__file__).resolve().parents[2]
GB = 10**9


@pytest.fixture(scope="module")
def doctor_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A doctor's JSON with round figures (what cachecd doctor --json writes; its shape is
    tested in test_doctor), so the projections can be checked by hand."""
    path = tmp_path_factory.mktemp("plan") / "doctor.json"
    report = json.loads(run_cli("doctor", "--cache-dir", str(path.parent / "c"), "--size",
                                "8MiB", "--block", "1MiB", "--json").stdout)
    report["memory"].update(total_bytes=64 << 30, available_bytes=56 << 30, gpu_bytes=None)
    report["disks"][0].update(cold={str(q): 2 * GB for q in (1, 4, 32)}, page_cache=8 * GB,
                              free_bytes=10**13)
    report["network"] = {"range_rate": 0.1 * GB, "resolve_s": 0.05}
    report["daemon"] = {"socket": "s", "model": "m", "expert_bytes": 0, "request_s": 0.001}
    path.write_text(json.dumps(report))
    return path


def _plan(*args: str) -> dict:
    return json.loads(run_cli("plan", *args, "--json", timeout=120).stdout)


def _check_rows(plan: dict, compute_s: float, call_s: float = 0.0, miss_s: float = 0.0) -> None:
    """Each row's tok/s is its compute, its calls' costs (the daemon's round trip 1 ms) and its
    bytes over the doctor's rates."""
    for r in plan["budgets"] + plan["pools"]:
        compute = (compute_s + r["calls_per_token"] * call_s
                   + r["miss_calls_per_token"] * (miss_s + 0.001))
        cold = compute + r["disk_bytes_per_token"] / (2 * GB) + r["hub_bytes_per_token"] / (0.1 * GB)
        assert r["tok_s_cold"] == pytest.approx(1 / cold, rel=1e-9)
        share, disk = r["page_cache_share"], r["disk_bytes_per_token"]
        warm = (compute + disk * share / (8 * GB) + disk * (1 - share) / (2 * GB)
                + r["hub_bytes_per_token"] / (0.1 * GB))
        assert r["tok_s_warm"] == pytest.approx(1 / warm, rel=1e-9)


def test_plan_on_the_tiny_model_with_flat_routing(doctor_json: Path, tmp_path: Path) -> None:
    from cachecd_engine.pool.memory import pool_bytes_for

    png = tmp_path / "curve.png"
    plan = _plan("--model", TINY_REPO, "--doctor", str(doctor_json), "--top-k", "4",
                 "--compute-ms", "10", "--call-ms", "0.5", "2", "--pool", "100KiB",
                 "--budget", str(3 * 6528), "--png", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = plan["model"]
    assert (m["moe_layers"], m["experts_per_layer"], m["top_k"]) == (5, 32, 4)
    assert m["bytes_per_token"] == 5 * 4 * 6528
    # The engine's default pool for these figures, less the resident model it loads first.
    want = pool_bytes_for(64 << 30, (56 << 30) - m["resident_bytes"], 0, None)
    assert plan["pool"]["bytes"] == plan["recommended"]["pool_bytes"] == want
    assert plan["budgets"][0]["slots"] == 160  # every expert fits: no more slots than experts
    # A run of 64 tokens starts with an empty pool: each of the 160 experts it routes to is
    # read once (64 tokens x 5 layers x top-4 asked), then held.
    assert all(r["pool_hit_rate"] == pytest.approx(1 - 160 / (64 * 20), abs=0.005)
               for r in plan["budgets"])
    small = next(r for r in plan["pools"] if r["pool_bytes"] == 100 << 10)
    assert small["slots"] == (100 << 10) // plan["pool"]["slot_bytes"] == 15
    assert small["pool_hit_rate"] == pytest.approx(15 / 160, abs=0.03)  # flat: C/N
    _check_rows(plan, 0.010, 0.0005, 0.002)
    assert small["calls_per_token"] == 5 and 4 < small["miss_calls_per_token"] <= 5
    # Where the run's reads come from: a budget of three experts holds three of the 160 the run
    # reads into its pool; the rest come from the Hub, whatever the pool holds afterwards.
    three = next(r for r in plan["budgets"] if r["budget"] == 3 * 6528)
    assert three["local_rate"] < 0.05 and three["disk_hit_rate"] < 0.05
    assert three["hub_bytes_per_token"] > 0.9 * 160 * 6528 / 64
    whole = plan["budgets"][-1]
    assert whole["local_rate"] == 1.0 and whole["hub_bytes_per_token"] == 0
    assert all(r["page_cache_share"] == 1.0 for r in plan["budgets"])  # they fit beside the pool
    assert plan["first_token_s"] == pytest.approx(  # 12 shards, 8 resolves at a time
        0.010 + 2 * 0.05 + m["bytes_per_token"] / (0.1 * GB))


def test_plan_from_a_trace_of_one_token_repeated(doctor_json: Path, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [{"format": "cachecd-trace", "version": 1, "model": TINY_REPO, "created": 0}]
    lines += [{"step": s, "layer": layer, "experts": [[1, 2]]}
              for s in range(6) for layer in range(1, 6)]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    plan = _plan("--model", TINY_REPO, "--doctor", str(doctor_json), "--trace", str(trace),
                 "--compute-ms", "5", "--call-ms", "1", "0", "--budget", "0")
    assert plan["model"]["top_k"] == 2 and plan["workload"].endswith("6 decode tokens")
    zero = next(r for r in plan["budgets"] if r["budget"] == 0)
    # Replayed twice, the second pass (a run) from an empty pool: its first token reads the
    # 10 experts (from the Hub: a budget of 0 keeps nothing), the five others find them held.
    assert zero["pool_hit_rate"] == pytest.approx(50 / 60)
    assert zero["hub_bytes_per_token"] == pytest.approx(10 * 6528 / 6)
    assert zero["miss_calls_per_token"] == pytest.approx(5 / 6) and zero["local_rate"] == 0
    assert zero["tok_s_cold"] == pytest.approx(
        1 / (0.005 + 5 * 0.001 + 5 / 6 * 0.001 + 10 * 6528 / 6 / (0.1 * GB)))
    assert run_cli("plan", "--model", "org/other", "--doctor", str(doctor_json), "--trace",
                   str(trace), check=False).returncode != 0


def test_plan_on_a_k3_shaped_manifest(doctor_json: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """K3's expert (17,547,264 bytes, mxfp4) and top-16 over 4 layers of 128 experts."""
    sys.path.insert(0, str(ROOT / "bench"))
    from manifest_load import synthetic_k3

    monkeypatch.setattr(constants, "K3_MOE_LAYERS", 4)
    monkeypatch.setattr(constants, "K3_EXPERTS_PER_LAYER", 128)
    path = tmp_path / "k3.manifest"
    synthetic_k3().save(path)
    plan = _plan("--model", str(path), "--doctor", str(doctor_json), "--compute-ms", "100",
                 "--call-ms", "0", "0",
                 "--pool", "4GiB", "--tokens", "32")
    m = plan["model"]
    assert m["top_k"] == 16 and m["bytes_per_token"] == 4 * 16 * constants.K3_EXPERT_BYTES
    assert plan["pool"]["slot_bytes"] == constants.K3_EXPERT_BYTES
    gib = next(r for r in plan["pools"] if r["pool_bytes"] == 4 << 30)
    assert gib["slots"] == 244  # about four tokens of experts
    # C/N once full, less the run's first tokens, which fill the empty pool.
    assert 244 / 512 - 0.1 <= gib["pool_hit_rate"] <= 244 / 512 + 0.01
    whole = plan["budgets"][-1]
    assert whole["budget"] == m["expert_bytes_total"] and whole["local_rate"] == 1.0
    _check_rows(plan, 0.100)
    assert plan["recommended"]["budget"] == whole["budget"]  # flat: every byte on disk pays


def test_the_engine_probe_reads_its_misses_through_a_daemon_serving_the_model(
        daemon, tiny_manifest) -> None:  # type: ignore[no-untyped-def]
    """Where the daemon serves the model with two calls' worth of one layer's experts cached,
    the probe's misses go through it (its round trip is then in the miss call), counting no use;
    with fewer cached, from a local file."""
    from cachecd.plan.probe import engine_costs
    from cachecd_client import Client

    layer, sock = tiny_manifest.moe_layers[0], str(daemon.socket)
    with Client(daemon.socket) as c:
        c.experts(TINY_REPO, layer, [0, 1, 2, 3])  # one call's worth
        few = engine_costs(tiny_manifest, 4, reps=2, socket=sock)
        c.experts(TINY_REPO, layer, list(range(4, 16)))
        before = c.coverage(TINY_REPO)["accesses"]
        got = engine_costs(tiny_manifest, 4, reps=2, socket=sock)
        cold = engine_costs(tiny_manifest, 4, reps=2, socket=sock,
                            cache_dirs=[str(daemon.cache_dir)])
        after = c.coverage(TINY_REPO)["accesses"]
    assert few.request_experts == 0 and got.request_experts == 4
    assert got.miss_s > 0 and got.miss_bytes == 4 * 6528
    assert after == before  # warming: no use counted
    # Its blobs found in the cache dir: the same calls with them dropped from the page cache.
    assert got.cold_miss_s is None and got.cold_rate(GB) is None
    assert cold.cold_miss_s is not None and 0 < (cold.cold_rate(GB) or 0) <= GB


def test_plan_projects_the_first_token_of_a_long_prompt(doctor_json: Path) -> None:
    """--prompt-tokens N: the first token of a prompt prefilled layer by layer, cold, warm and
    from the pool, grows with the prompt and shrinks with a pool that holds a layer's experts."""
    from cachecd.plan.prompt import distinct

    common = ("--model", TINY_REPO, "--doctor", str(doctor_json), "--top-k", "4",
              "--compute-ms", "10", "--call-ms", "0.5", "2", "--prefill-step-size", "16",
              "--prefill-ms", "100")

    def prompt(tokens: int, pool: str) -> dict:
        return _plan(*common, "--prompt-tokens", str(tokens), "--pool", pool)["prompt"]

    small, big = prompt(200, "100KiB"), prompt(200, "10MiB")
    assert small["slots"] == 15 and big["slots"] == 160 and big["pool_holds_a_layer"]
    assert big["reads"] == pytest.approx(4 * distinct(32, 4, 200) + 4, abs=0.1)  # once each
    assert small["reads"] > 2 * big["reads"] and "docs/engine.md" in small["note"]
    longer = prompt(400, "100KiB")
    for case in ("cold", "warm", "pool"):
        assert small["first_token_s"][case] > big["first_token_s"][case]
        assert longer["first_token_s"][case] > small["first_token_s"][case]
    # The pool holding every routed expert: the compute and the calls alone.
    assert big["first_token_s"]["pool"] == pytest.approx(0.1 + (4 * 14 + 1 + 5) * 0.0005)
    table = run_cli("plan", *common, "--prompt-tokens", "200", "--pool", "100KiB",
                    timeout=120).stdout
    assert "prompt of 200 tokens (14 steps of 16, layer by layer)" in table, table
    assert "cold from the Hub" in table and "note: the pool holds 15 experts" in table
