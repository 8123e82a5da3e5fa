"""The benches still run: each core function at a tiny size, real hub and daemon processes.

Nothing here looks at a timing: a bench that rots (an API it calls changed, bytes that no longer
match the manifest, a last line that is not ``ratio=X``) fails; a slow machine does not.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
RATIO_LINE = re.compile(r"^ratio=\d+\.\d{3}$")


def _load(name: str) -> ModuleType:
    # The benches import their helpers by plain name, as they do when run as scripts; the
    # modules themselves get prefixed names so they cannot shadow the repo's engine/ package.
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def served() -> Iterator[object]:
    _load("hits")  # puts bench/ on sys.path: _common is then the module the benches share
    common = importlib.import_module("_common")
    with common.served_checkpoint("/tmp", "bench/smoke", experts=8, layers=3) as s:
        yield s
    assert not s.work.exists(), "the bench left its work dir behind"


def _finite_positive(*values: float) -> None:
    for v in values:
        assert math.isfinite(v) and v > 0, values


def _last_line(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_hits_core(served) -> None:  # type: ignore[no-untyped-def]
    res = _load("hits").measure(served, n_ids=4, reps=1, readers=2, rounds=1)
    _finite_positive(res.ours_gibs, res.raw_gibs, res.ratio, res.paired)
    assert res.bytes_per_case == 4 * int(served.manifest.sizes.max())
    assert not served.daemons, "the bench must stop its daemon"


def test_reopen_core(served) -> None:  # type: ignore[no-untyped-def]
    res = _load("reopen").measure(served, n_ids=3, readers=2, rounds=2)
    _finite_positive(res.ratio, *res.ours_s, *res.raw_s)
    assert res.hashed_per_round == [3, 3]  # a restart, then every blob asked for is hashed
    assert not served.daemons, "the bench must stop its daemon"


def test_overhead_core(served) -> None:  # type: ignore[no-untyped-def]
    overhead = _load("overhead")
    token = overhead.plan_token(served, 7, 4)
    assert [layer for layer, _ in token] == [
        served.manifest.moe_layers[i % len(served.manifest.moe_layers)] for i in range(7)
    ]
    assert all(len(ids) == 4 == len(set(ids)) for _, ids in token)
    res = overhead.measure(served, calls=3, n_ids=4, readers=2, rounds=1)
    _finite_positive(res.ours_s, res.raw_s, res.ratio, res.paired)
    assert res.requests == 12
    assert not served.daemons, "the bench must stop its daemon"


def test_cold_core(served) -> None:  # type: ignore[no-untyped-def]
    cold = _load("cold")
    ids = cold.pick_ids(served, 3, "random")
    assert len(set(ids)) == 3 and ids == sorted(ids)
    res = cold.measure(served, ids=ids, rounds=1, parallel=2)
    _finite_positive(res.ours_mbs, res.curl_mbs, res.curl_fsync_mbs, res.ratio, res.paired)
    assert res.upstream_requests >= 1
    assert res.nbytes == sum(
        served.manifest.expert(served.manifest.moe_layers[0], e).nbytes for e in ids
    )
    assert not served.daemons, "every round must stop its daemon"


def test_peer_core(served) -> None:  # type: ignore[no-untyped-def]
    res = _load("peer").measure(served, [0, 1], rounds=1)
    _finite_positive(res["peer"], res["hub"], res["paired"])
    assert not served.daemons, "the bench must stop the sharing daemon and every round's"


def test_xet_core(served) -> None:  # type: ignore[no-untyped-def]
    """Both routes read the same layer from the smoke checkpoint's hub, which keeps it in Xet."""
    res = _load("xet").measure(served, rounds=1)
    _finite_positive(res.xet_mbs, res.plain_mbs, res.ratio, res.proof_bytes_per_expert,
                     res.xorb_bytes_per_expert)
    assert res.experts == served.manifest.experts_per_layer


def test_overhead_script_ends_with_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    _load("overhead").main(["--calls", "2", "--ids", "3", "--rounds", "1", "--readers", "2"])
    assert RATIO_LINE.match(_last_line(capsys))


def test_engine_script_ends_with_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    _load("engine").main(["--rounds", "1", "--tokens", "2"])
    out = capsys.readouterr().out
    assert "same tokens from all three" in out
    assert RATIO_LINE.match(out.strip().splitlines()[-1])


def test_ram_tier_core() -> None:
    ram_tier = _load("ram_tier")
    traces = importlib.import_module("traces")  # the module ram_tier itself imports
    spec = traces.SynthSpec(
        name="tiny", layers=3, experts=16, top_k=4, tokens=160, seq_len=(8, 40), burst_experts=4
    )
    raw = traces.synthetic(spec)
    view = [ram_tier.engine_view(s, 6) for s in (raw.train, raw.test)]
    for s in view:  # batches of at most 6 distinct experts of one layer, ascending
        for batch in np.split(s.keys, s.starts[1:]):
            assert 0 < batch.size <= 6 and np.all(np.diff(batch) > 0)
            assert np.unique(batch // traces.KEY_STRIDE).size == 1
    split = traces.Split(raw.name, view[0], view[1], raw.n_experts)
    trace = ram_tier.Trace(split, spec.layers * spec.top_k)
    rows = ram_tier.evaluate([trace], jobs=1)
    assert [r.capacity for r in rows] == ram_tier.capacities(trace)
    assert len(rows) == len(set(ram_tier.capacities(trace))) >= 5
    for r in rows:
        assert set(r.rates) == {*ram_tier.CANDIDATES, *ram_tier.PROTOTYPES, "fixed*", "Belady"}
        assert 0 < r.rates["Belady"] <= 1
        for policy, rate in r.rates.items():
            assert 0 <= rate <= r.rates["Belady"], (r.capacity, policy, r.rates)
    cells = ram_tier.table(rows)
    assert len(cells) == len(rows) + 1
    assert {len(c) for c in cells} == {len(cells[0])}
    assert cells[0][:4] == ["trace", "tokens", "experts", "%all"] and "Belady" in cells[0]
    assert ram_tier.recommend(rows) in ram_tier.CANDIDATES


def test_ram_tier_script_ends_with_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    _load("ram_tier").main(["--no-engine", "--tokens", "48", "--layers", "2", "--jobs", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3].startswith("recommended default: ")
    assert RATIO_LINE.match(lines[-1])


def test_pool_policy_script_ends_with_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    _load("pool_policy").main(["--families", "k3-scaled,synth", "--seeds", "1",
                               "--scaled-tokens", "40", "--synth-tokens", "400"])
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line for line in lines if line.startswith("| k3-scaled") or line.startswith("| synth")]
    assert len(rows) == 10 and RATIO_LINE.match(lines[-1])


def test_bank_host_script_counts_the_banks_work(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load("bank_host")
    bench.main(["--cases", "top4-122-miss,top4-368-hit", "--tokens", "1", "--profile", "3"])
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split("|") for line in lines if line.startswith("| top4-")]
    assert [r[1].strip() for r in rows] == ["top4-122-miss", "top4-368-hit"]
    assert float(rows[1][5]) == 1.0 and float(rows[0][5]) < 1.0  # the hit case hits, all
    assert any("(run)" in line for line in lines)  # the profile names the bank's call
    assert re.match(r"^plan_us_per_call_max=\d+\.\d$", lines[-1])
    # The same routing and pool give the same decisions (the digest is of the slots given).
    case = bench.cases(4000)[0]
    assert bench.measure(case, 1).decisions == bench.measure(case, 1).decisions


def test_k3_delivery_core(served) -> None:  # type: ignore[no-untyped-def]
    res = _load("k3_delivery").measure(served, n_ids=4, reps=1, readers=2, rounds=1)
    _finite_positive(res.ours_gibs, res.raw_gibs, res.ratio, res.paired)
    assert res.copies_per_expert == 1.0  # one copy: page cache to the kernel's arrays
    assert res.bytes_per_case == 4 * int(served.manifest.sizes.max())


def test_k3_decode_script_ends_with_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    _load("k3_decode").main(["--tiny-experts", "--experts", "8", "--layers", "3", "--top-k", "4",
                             "--tokens", "2", "--rounds", "1", "--small", "40KB",
                             "--throttle", "100"])
    out = capsys.readouterr().out
    assert "the same tokens from every case" in out and "host overhead" in out
    assert "token / (raw read + resident token)" in out
    assert RATIO_LINE.match(out.strip().splitlines()[-1])


def test_prefill_script_reads_each_expert_once_layer_by_layer(
        capsys: pytest.CaptureFixture[str]) -> None:
    _load("prefill").main(["--tiny-experts", "--experts", "8", "--layers", "3", "--top-k", "4",
                           "--tokens", "40", "--steps", "8,4"])
    out = capsys.readouterr().out
    assert "bitwise the resident model's" in out
    layers = re.findall(r"layers +TTFT .*? = (\d+\.\d+)x one pass", out)
    steps = re.findall(r"steps +TTFT .*? = (\d+\.\d+)x one pass", out)
    assert len(layers) == len(steps) == 2, out
    assert all(float(x) <= 1.0 for x in layers) and all(float(x) > 1.5 for x in steps), out
    assert RATIO_LINE.match(out.strip().splitlines()[-1])


def test_prefill_script_with_half_a_layer_reads_each_expert_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A pool of half a layer's experts: the layer's steps taken together read each routed
    expert once; in turn they read some again."""
    _load("prefill").main(["--tiny-experts", "--experts", "8", "--layers", "3", "--top-k", "4",
                           "--tokens", "40", "--steps", "8", "--pool-layers", "0.5"])
    out = capsys.readouterr().out
    assert "bitwise the resident model's" in out and "0.5 layer's experts (4 slots)" in out, out
    layers = re.findall(r"layers +TTFT .*? = (\d+\.\d+)x one pass", out)
    inturn = re.findall(r"inturn +TTFT .*? = (\d+\.\d+)x one pass", out)
    assert len(layers) == len(inturn) == 1, out
    assert float(layers[0]) <= 1.0 < float(inturn[0]), out


def test_batching_script_ends_with_its_summary(capsys: pytest.CaptureFixture[str]) -> None:
    _load("batching").main(["--tiny-experts", "--experts", "8", "--layers", "3", "--top-k", "2",
                            "--prompt", "4", "--tokens", "3", "--streams", "1,2", "--skew", "0.2"])
    last = _last_line(capsys)
    assert re.fullmatch(r"batching streams=1,2 tok_s=\S+ resident_tok_s=\S+ ratio=\S+ "
                        r"bytes_per_token=\d+,\d+ read_vs_one=1\.000,\S+ "
                        r"routed_share=1\.000,\S+ same=1,1 dtype=float32 device=(cpu|gpu)",
                        last), last


def test_index_start_script_ends_with_the_crash_open_time(capsys: pytest.CaptureFixture[str]) -> None:
    _load("index_start").main(["--experts", "300", "--rounds", "1"])
    assert re.fullmatch(r"crash_open_s=\d+\.\d{3}", _last_line(capsys))


def test_layout_check_core(tmp_path: Path) -> None:
    from cachecd.manifest.build import build_manifest
    from cachecd.manifest.source import LocalSource
    from cachecd.testbed.tiny_model import write_tiny_model

    write_tiny_model(tmp_path / "m")
    m = build_manifest(LocalSource(tmp_path / "m", "bench/smoke", "ab" * 20), progress=False)
    bench = _load("layout_check")
    heads = bench.headers_of(m)
    assert sorted(heads) == sorted(m.shards)
    _finite_positive(*bench.measure(m, heads, runs=1))


def test_prompt_check_script_ends_with_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    _load("prompt_check").main(["--models", "tiny", "--tokens", "40", "--step", "8",
                                "--rounds", "1"])
    out = capsys.readouterr().out
    reads = re.findall(r"reads +projected +(\d+\.\d) +measured +(\d+\.\d)", out)
    assert len(reads) == 2 and all(float(p) > 0 and float(m) > 0 for p, m in reads), out
    assert len(re.findall(r"first token (warm|cold) s +projected", out)) == 4, out
    assert RATIO_LINE.match(out.strip().splitlines()[-1])
