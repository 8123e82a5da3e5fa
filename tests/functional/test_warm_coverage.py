"""`cachecd warm` and `cachecd coverage` as a user runs them, against a real daemon: the numbers
are checked against what was actually fetched (the daemon's counters, blob files on disk)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachecd.report.coverage import unpack_detail
from tests.fakes.fake_hub import FakeHubThread
from tests.harness import CACHECD, TINY_REPO, DaemonProcess, run_cli, stop_daemon

# (layer position, expert) -> how many requests; the workload the daemon records.
WORKLOAD = {(0, 0): 5, (1, 7): 4, (0, 1): 3, (0, 2): 2, (0, 3): 1}


def _blobs_on_disk(d: DaemonProcess) -> set[str]:
    return {f.name for f in (d.cache_dir / "blobs").rglob("*") if f.is_file()}


def _digest(manifest: Any, layer: int, expert: int) -> str:
    return manifest.expert(layer, expert).digest_hex


def _detail(c: Any, manifest: Any) -> tuple[np.ndarray, np.ndarray]:
    return unpack_detail(c.coverage(TINY_REPO, detail=True)["detail"])


def _access(c: Any, manifest: Any, layer: int, expert: int) -> int:
    return int(_detail(c, manifest)[1][manifest.row(layer, expert)])


def _record_workload(d: DaemonProcess, manifest: Any) -> dict[tuple[int, int], int]:
    """Ask for experts one request at a time, then evict them all: counts stay, bytes go."""
    counts = {}
    with d.client() as c:
        for (pos, expert), n in WORKLOAD.items():
            layer = manifest.moe_layers[pos]
            counts[(layer, expert)] = n
            for _ in range(n):
                c.experts(TINY_REPO, layer, [expert])
        c.evict(1 << 40)
        assert c.stats()["store"]["entries"] == 0
    return counts


def _warm(d: DaemonProcess, *args: str, check: bool = True) -> tuple[dict[str, Any], Any]:
    proc = run_cli("warm", "--model", TINY_REPO, "--socket", str(d.socket), "--json", *args,
                   check=check)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc


def _wait_idle(c: Any) -> None:
    for _ in range(400):
        if c.stats()["inflight"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the daemon kept fetching")


def _flushed_access(cache_dir: Path, key: str) -> dict[tuple[int, int], int]:
    """The access rows committed to LMDB, read from outside the daemon (read-only)."""
    import lmdb

    prefix = b"m" + key.encode() + b"\x00"
    env = lmdb.open(str(cache_dir / "index.lmdb"), readonly=True, max_dbs=8, subdir=True)
    try:
        db = env.open_db(b"access", create=False)
        with env.begin(db=db) as txn:
            return {struct.unpack(">ii", k[len(prefix):]): struct.unpack("<Qd", v)[0]
                    for k, v in txn.cursor() if k.startswith(prefix)}
    finally:
        env.close()


def test_access_counts_once_per_request_flushed_in_batches_survive_kill_9_and_restart(
        daemon, tiny_manifest):
    layer = tiny_manifest.moe_layers[1]
    with daemon.client() as c:
        c.experts(TINY_REPO, layer, [4, 4, 5])  # a repeated id is one use of that expert
        c.experts(TINY_REPO, layer, [4])
        assert _access(c, tiny_manifest, layer, 4) == 2
        assert _access(c, tiny_manifest, layer, 5) == 1
        assert c.stats()["counters"]["expert_requests"] == 3
    want = {(layer, 4): 2, (layer, 5): 1}
    for _ in range(200):  # the writer flushes on its own, no shutdown needed
        if _flushed_access(daemon.cache_dir, tiny_manifest.key) == want:
            break
        time.sleep(0.05)
    assert _flushed_access(daemon.cache_dir, tiny_manifest.key) == want
    daemon.kill()
    again = DaemonProcess(daemon.endpoint, [], cache_dir=daemon.cache_dir, socket=daemon.socket)
    try:
        with again.start().client() as c:
            c.experts(TINY_REPO, layer, [5])
            assert _access(c, tiny_manifest, layer, 4) == 2
            assert _access(c, tiny_manifest, layer, 5) == 2
        assert again.stop() == 0  # a clean stop flushes what is pending
    finally:
        again.cleanup()
    last = DaemonProcess(daemon.endpoint, [], cache_dir=daemon.cache_dir, socket=daemon.socket)
    try:
        with last.start().client() as c:
            assert _access(c, tiny_manifest, layer, 5) == 2
    finally:
        last.cleanup()


def test_warm_top_bytes_resume_from_daemon_stats(daemon, tiny_manifest):
    m = tiny_manifest
    counts = _record_workload(daemon, m)
    with daemon.client() as c:
        fetched0 = c.stats()["counters"]["fetched_experts"]
    got, proc = _warm(daemon, "--top", "3")
    top3 = [(m.moe_layers[0], 0), (m.moe_layers[1], 7), (m.moe_layers[0], 1)]
    assert got["fetched"] == 3 and got["hit_rate_before"] == 0.0
    assert got["hit_rate_after"] == pytest.approx(12 / 15)
    assert "expected hit rate: 0.0% before, 80.0% after" in proc.stdout
    assert _blobs_on_disk(daemon) == {_digest(m, *k) for k in top3}
    with daemon.client() as c:
        assert c.stats()["counters"]["fetched_experts"] == fetched0 + 3
        access = _detail(c, m)[1]
    # Warming is not use: the counts it ranks by are unchanged.
    assert {k: int(access[m.row(*k)]) for k in counts} == counts and access.sum() == 15
    got, _ = _warm(daemon, "--bytes", str(int(m.sizes[0])))  # one expert's worth
    assert got["fetched"] == 1 and _digest(m, m.moe_layers[0], 2) in _blobs_on_disk(daemon)
    got, proc = _warm(daemon, "--top", "100")
    assert got["fetched"] == 1 and got["hit_rate_after"] == 1.0, (got, proc.stderr)
    got, proc = _warm(daemon, "--top", "100")  # everything wanted is cached: nothing to do
    assert got["fetched"] == 0 and got["hit_rate_before"] == 1.0
    assert "warming 0 experts" in proc.stdout and "nothing to warm: all 5 experts" in proc.stderr
    assert len(_blobs_on_disk(daemon)) == len(counts)


def _write_trace(path: Path, manifest: Any, picks: list[tuple[int, list[int]]]) -> None:
    from cachecd_engine.trace import TraceRecorder

    rec = TraceRecorder(path, TINY_REPO)
    for pos, ids in picks:
        rec(manifest.moe_layers[pos], np.array([ids]))
    rec.close()


def test_warm_trace_then_coverage_of_that_trace(daemon, tiny_manifest, tmp_path):
    m = tiny_manifest
    trace = tmp_path / "t.jsonl"
    picks = [(0, [1, 2, 3, 4]), (1, [1, 2, 30, 31]), (0, [1, 2, 5, 6])]
    _write_trace(trace, m, picks)
    wanted = {(m.moe_layers[pos], e) for pos, ids in picks for e in ids}
    got, _proc = _warm(daemon, "--trace", str(trace))
    assert got["fetched"] == len(wanted) == 10
    assert got["hit_rate_before"] == 0.0 and got["hit_rate_after"] == 1.0
    assert _blobs_on_disk(daemon) == {_digest(m, *k) for k in wanted}
    with daemon.client() as c:
        assert _detail(c, m)[1].sum() == 0  # replaying a trace records no use
    out = run_cli("coverage", "--model", TINY_REPO, "--socket", str(daemon.socket), "--trace",
                  str(trace), "--json").stdout  # --json: the same as --format json
    report = json.loads(out)
    assert report["workload_coverage"] == 1.0 and report["accesses"] == 12
    assert report["experts_cached"] == 10 and report["workload"] == f"trace {trace}"


def test_warm_and_coverage_take_several_traces_and_gzip_ones(daemon, tiny_manifest, tmp_path):
    import gzip

    m = tiny_manifest
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write_trace(first, m, [(0, [1, 2, 3, 4])])
    _write_trace(second, m, [(1, [1, 2, 30, 31]), (0, [1, 2, 5, 6])])
    packed = tmp_path / "b.jsonl.gz"
    packed.write_bytes(gzip.compress(second.read_bytes()))
    got, _proc = _warm(daemon, "--trace", str(first), str(packed))
    assert got["fetched"] == 10 and got["hit_rate_after"] == 1.0  # the union of both traces
    out = run_cli("coverage", "--model", TINY_REPO, "--socket", str(daemon.socket), "--trace",
                  str(first), "--trace", str(packed), "--format", "json").stdout
    report = json.loads(out)
    assert report["accesses"] == 12 and report["workload_coverage"] == 1.0
    assert report["workload"] == f"traces {first}, {packed}"


def test_coverage_formats_match_the_daemon(daemon, tiny_manifest, tmp_path):
    m = tiny_manifest
    with daemon.client() as c:
        for pos, ids in ((0, [0, 1, 2]), (0, [1, 2]), (3, [5, 6, 7, 8]), (4, [31])):
            c.experts(TINY_REPO, m.moe_layers[pos], ids)
        stats = c.stats()
    sock = ["--model", TINY_REPO, "--socket", str(daemon.socket)]
    report = json.loads(run_cli("coverage", *sock, "--format", "json").stdout)
    on_disk = _blobs_on_disk(daemon)
    assert report["experts_cached"] == stats["store"]["entries"] == len(on_disk) == 8
    assert report["bytes_cached"] == stats["store"]["bytes"]
    assert report["bytes_cached"] == sum(
        f.stat().st_size for f in (daemon.cache_dir / "blobs").rglob("*") if f.is_file())
    assert report["experts_total"] == m.n_experts
    layers = {row["layer"]: row for row in report["layers"]}
    assert [layers[m.moe_layers[p]]["experts_cached"] for p in range(5)] == [3, 0, 0, 4, 1]
    assert all(row["experts_total"] == 32 for row in report["layers"])
    assert report["accesses"] == 10 and report["workload_coverage"] == 1.0
    hist = report["history"]
    assert hist["hits"] == stats["counters"]["expert_hits"] == 2
    assert hist["misses"] == stats["counters"]["expert_misses"] == 8
    table = run_cli("coverage", *sock).stdout
    assert "8 of 160 experts" in table and "expected hit rate 100.0%" in table
    png = tmp_path / "heat.png"
    run_cli("coverage", *sock, "--format", "png", "--output", str(png))
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 600 and height >= 200 and 5_000 < len(data) < 2_000_000
    page = tmp_path / "report.html"
    run_cli("coverage", *sock, "--format", "html", "--output", str(page))
    text = page.read_text()
    assert "http://" not in text and "https://" not in text
    assert "<table>" in text and "data:image/png;base64," in text and "experts cached" in text
    bad = run_cli("coverage", *sock, "--format", "png", check=False)
    assert bad.returncode == 1 and "--output" in bad.stderr


def test_warm_stops_at_the_budget_and_reports_daemon_errors(hub, tiny_manifest, tiny_manifest_path):
    m = tiny_manifest
    expert = int(m.sizes.max())
    d = DaemonProcess(hub.url, [tiny_manifest_path], args=["--budget", str(expert * 3)]).start()
    try:
        _record_workload(d, m)
        got, proc = _warm(d, "--top", "5")
        assert got["fetched"] == 3 and "budget:" in proc.stderr and "warming 3 of 5" in proc.stderr
        with d.client() as c:
            assert c.stats()["store"]["bytes"] <= expert * 3
    finally:
        d.cleanup()
    tiny = DaemonProcess(hub.url, [tiny_manifest_path], args=["--budget", str(expert // 2)]).start()
    try:
        with tiny.client() as c:
            c.warm(TINY_REPO, m.moe_layers[0], [])  # an empty batch is fine
        trace = tiny.base / "t.jsonl"
        _write_trace(trace, m, [(0, [1])])
        got, proc = _warm(tiny, "--trace", str(trace), "--allow-evict", check=False)
        assert proc.returncode == 1 and got["exit"] == 1 and got["fetched"] == 0
        assert "too_large" in proc.stderr and "run the same command again" in proc.stderr
    finally:
        tiny.cleanup()


def test_ctrl_c_loses_nothing_and_a_rerun_resumes(tiny_manifest, tiny_dir, tiny_manifest_path,
                                                   tmp_path):
    m = tiny_manifest
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, m, [(pos, list(range(8))) for pos in range(5)])  # 40 experts
    with FakeHubThread(tiny_dir, repo=TINY_REPO, revision=m.revision) as fake:
        fake.faults.delay = 0.2
        d = DaemonProcess(fake.url, [tiny_manifest_path]).start()
        fake.clear_records()  # the registration's header reads (the layout check) are not warm's
        try:
            argv = [*CACHECD, "warm", "--model", TINY_REPO, "--socket", str(d.socket), "--trace",
                    str(trace), "--batch", "1", "--parallel", "2", "--json"]
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ})
            with d.client() as c:
                while c.stats()["counters"].get("fetched_experts", 0) < 2:
                    assert proc.poll() is None, proc.communicate()
                    time.sleep(0.02)
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=60)
                assert proc.returncode == 130, err
                assert "interrupted" in err
                _wait_idle(c)
                first = int(_detail(c, m)[0].sum())
            assert 2 <= first < 40 and len(_blobs_on_disk(d)) == first
            # What it says it fetched is what landed, the requests in flight at Ctrl-C included.
            said = json.loads(out.strip().splitlines()[-1])
            assert said["fetched"] == first and said["experts_cached"] == first, (said, err)
            got, _ = _warm(d, "--trace", str(trace))
            assert got["fetched"] == 40 - first and got["hit_rate_after"] == 1.0
            with d.client() as c:
                assert c.stats()["counters"]["fetched_experts"] == 40  # nothing fetched twice
            ranges = sum(len(m.expert(m.moe_layers[p], e).ranges) for p in range(5) for e in range(8))
            assert fake.count("cdn_get") <= ranges
        finally:
            d.cleanup()


PROMPTS = ["Experts stream from the hub into a verified cache.",
           "A second prompt routes to other experts, layer after layer."]


@pytest.fixture
def installed(hub, tiny_manifest_path):  # type: ignore[no-untyped-def]
    from tests.harness import short_tmp

    base = short_tmp("cdw")
    sock = base / "run" / "s.sock"
    run_cli("setup", "--stream", TINY_REPO, "--endpoint", hub.url, "--socket", str(sock),
            "--cache-dir", str(base / "cache"), "--models-dir", str(base / "models"),
            "--manifest", str(tiny_manifest_path))
    inst = DaemonProcess(hub.url, cache_dir=base / "cache", socket=sock)
    yield inst
    stop_daemon(sock)
    inst.cleanup()


def test_warm_prompts_is_not_use_and_run_trace_replays(installed, tiny_manifest, tmp_path,
                                                       tiny_dir):
    from mlx_lm.utils import load_tokenizer

    from cachecd_engine.trace import read_trace

    m, d = tiny_manifest, installed
    prompts, saved = tmp_path / "p.txt", tmp_path / "w.jsonl"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    got, _proc = _warm(d, "--prompts", str(prompts), "--max-new", "2", "--save-trace", str(saved))
    assert got["hit_rate_before"] == 0.0 and got["hit_rate_after"] == 1.0  # setup fetched none
    with d.client() as c:
        cached, access = _detail(c, m)
        counters = c.stats()["counters"]
        assert got["fetched"] == int(cached.sum()) == counters["fetched_experts"]
        # Warming is not use: no access counted, no hit or miss, its fetches counted as warm.
        assert access.sum() == 0, access.sum()
        assert counters.get("expert_requests", 0) == counters.get("expert_misses", 0) == 0
        assert 0 < counters["warm_fetched_experts"] <= got["fetched"]
    assert len(_blobs_on_disk(d)) == got["fetched"] > 0
    trace = read_trace(saved)
    assert {layer for layer, _ in trace.counts} == set(m.moe_layers)
    # Each prompt went in the chat template, as `cachecd run` sends it: the first prefill routed
    # one row per token of the templated prompt but its last (mlx-lm decodes that one).
    tokenizer = load_tokenizer(tiny_dir)
    templated = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                              add_generation_prompt=True)
    first = json.loads(saved.read_text().splitlines()[1])
    assert first["step"] == 0 and len(first["experts"]) + 1 == len(templated) > len(PROMPTS[0])
    assert all(cached[m.row(layer, expert)] for layer, expert in trace.counts)
    flag, env = tmp_path / "run.jsonl", tmp_path / "env.jsonl"
    common = ["run", "--model", TINY_REPO, "--prompt", PROMPTS[0], "--max-new", "2",
              "--socket", str(d.socket)]
    run_cli(*common, "--trace", str(flag))
    with d.client() as c:  # running the model is use
        assert _detail(c, m)[1].sum() > 0 and c.stats()["counters"]["expert_requests"] > 0
    run_cli(*common, env={"CACHECD_TRACE": str(env)})
    by_flag, by_env = read_trace(flag), read_trace(env)
    assert by_flag.counts == by_env.counts and by_flag.steps >= 2 and by_flag.model == TINY_REPO
    run_cli(*common, "--trace", str(env))  # a second run appends to the trace, as a run of its own
    both = read_trace(env)
    assert both.counts == by_env.counts + by_env.counts and both.steps == 2 * by_env.steps
    assert sum('"format"' in line for line in env.read_text().splitlines()) == 2
    assert set(by_flag.counts) <= set(trace.counts)  # the same prompt routes the same way
    got, _ = _warm(d, "--trace", str(flag))
    assert got["fetched"] == 0 and got["hit_rate_before"] == 1.0
