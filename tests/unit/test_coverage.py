"""Coverage report numbers, the warm plan, routing traces and the renderers, on the shipped
tiny manifest (a real manifest: 5 MoE layers x 32 experts) and hand-made workloads."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from cachecd.ctl.warm import fit_room, plan_batches, read_prompts
from cachecd.errors import InvalidRequest
from cachecd.manifest.manifest import Manifest, shipped_manifest
from cachecd.report.coverage import (
    HitHistory,
    access_array,
    bytes_to_reach,
    coverage_report,
    most_wanted,
    pack_detail,
    rows_of,
    unpack_detail,
    warm_order,
)
from cachecd.report.coverage_render import Grid, render_html, render_json, render_png, render_table
from cachecd_engine.trace import TraceRecorder, read_trace, read_traces


@pytest.fixture(scope="module")
def m() -> Manifest:
    path = shipped_manifest("cachecd/tiny-k3")
    assert path is not None
    return Manifest.load(path)


def _workload(m: Manifest, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    access = rng.zipf(1.6, m.n_experts).astype(np.int64)
    access[rng.random(m.n_experts) < 0.3] = 0
    cached = rng.random(m.n_experts) < 0.4
    return cached, access


def test_rows_match_manifest_row_and_unknowns_are_minus_one(m: Manifest) -> None:
    layers = np.repeat(np.array(m.moe_layers), m.experts_per_layer)
    experts = np.tile(np.arange(m.experts_per_layer), len(m.moe_layers))
    rows = rows_of(m, layers, experts)
    assert rows.tolist() == [m.row(int(a), int(b)) for a, b in zip(layers, experts, strict=True)]
    bad = rows_of(m, np.array([0, 99, m.moe_layers[0], m.moe_layers[0]]),
                  np.array([0, 0, -1, m.experts_per_layer]))
    assert bad.tolist() == [-1, -1, -1, -1]


def test_access_array_maps_counts_to_rows_and_drops_foreign_experts(m: Manifest) -> None:
    first, last = m.moe_layers[0], m.moe_layers[-1]
    counts = {(first, 3): (7, 1.0), (last, 31): (2, 2.0), (0, 5): (100, 3.0), (first, 99): (9, 0.0)}
    arr = access_array(m, counts)
    assert arr.sum() == 9
    assert arr[m.row(first, 3)] == 7 and arr[m.row(last, 31)] == 2
    assert access_array(m, {(first, 4): 5})[m.row(first, 4)] == 5  # plain ints too
    assert access_array(m, {}).sum() == 0


def test_report_numbers_by_hand(m: Manifest) -> None:
    cached, access = _workload(m)
    report = coverage_report(m, cached, access)
    assert report["experts_total"] == m.n_experts == 160
    assert report["experts_cached"] == int(cached.sum())
    assert report["bytes_cached"] == int(m.sizes[cached].sum())
    assert report["workload_coverage"] == pytest.approx(access[cached].sum() / access.sum())
    assert [row["layer"] for row in report["layers"]] == list(m.moe_layers)
    for row in report["layers"]:
        sel = m.layer_ids == row["layer"]
        assert row["experts_total"] == int(sel.sum())
        assert row["experts_cached"] == int((sel & cached).sum())
        assert row["bytes_cached"] == int(m.sizes[sel & cached].sum())
        assert row["accesses"] == int(access[sel].sum())
    assert sum(r["experts_cached"] for r in report["layers"]) == report["experts_cached"]
    json.dumps(report)  # plain types only


def test_no_workload_gives_none_not_a_guess(m: Manifest) -> None:
    report = coverage_report(m, np.zeros(m.n_experts, bool), np.zeros(m.n_experts, np.int64))
    assert report["workload_coverage"] is None and report["most_wanted"] == []
    assert all(r["bytes_more"] is None for r in report["to_reach"])


def test_most_wanted_are_missing_and_ordered(m: Manifest) -> None:
    cached, access = _workload(m, 1)
    wanted = most_wanted(m, cached, access, top=10)
    counts = [w["accesses"] for w in wanted]
    assert counts == sorted(counts, reverse=True) and len(wanted) == 10
    for w in wanted:
        assert not cached[m.row(w["layer"], w["expert"])]
    best_missing = int(access[~cached].max())
    assert counts[0] == best_missing


def test_bytes_to_reach_a_small_case() -> None:
    sizes = np.array([10, 10, 10, 10, 10])
    cached = np.array([True, False, False, False, False])
    access = np.array([50, 30, 15, 5, 0])  # 50% already
    rows = bytes_to_reach(sizes, cached, access, (0.5, 0.8, 0.9, 0.95, 0.99, 1.0))
    got = {r["target"]: (r["bytes_more"], r["experts_more"]) for r in rows}
    assert got == {0.5: (0, 0), 0.8: (10, 1), 0.9: (20, 2), 0.95: (20, 2), 0.99: (30, 3),
                   1.0: (30, 3)}
    assert warm_order(sizes, cached, access).tolist() == [1, 2, 3]  # never the unused expert


def test_bytes_to_reach_prefers_accesses_per_byte() -> None:
    sizes = np.array([100, 10, 10])
    access = np.array([20, 15, 15])
    rows = bytes_to_reach(sizes, np.zeros(3, bool), access, (0.5,))
    assert rows[0] == {"target": 0.5, "bytes_more": 20, "experts_more": 2}


def test_detail_round_trip(m: Manifest) -> None:
    cached, access = _workload(m, 2)
    back_cached, back_access = unpack_detail(json.loads(json.dumps(pack_detail(cached, access))))
    assert np.array_equal(back_cached, cached) and np.array_equal(back_access, access)


def test_history_buckets_and_expiry() -> None:
    now = [1000.0]
    h = HitHistory(bucket_s=60, buckets=3, clock=lambda: now[0])
    h.record("a", 2, 1)
    now[0] = 1010
    h.record("a", 1, 0)
    now[0] = 1070
    h.record("a", 0, 4)
    h.record("b", 9, 9)
    snap = h.snapshot("a")
    assert [(b["t"], b["hits"], b["misses"]) for b in snap["buckets"]] == [(960, 3, 1), (1020, 0, 4)]
    assert (snap["hits"], snap["misses"]) == (3, 5)
    now[0] = 1150  # bucket 1140: the last three are 1020..1140, so 960 goes
    h.record("a", 1, 1)
    assert [b["t"] for b in h.snapshot("a")["buckets"]] == [1020, 1140]
    assert h.snapshot("nobody")["buckets"] == []


def test_trace_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(path, "org/m")
    prefill = np.array([[[1, 2], [2, 3], [1, 4]]])  # (batch, tokens, top_k)
    rec(1, prefill)
    rec(2, prefill + 10)
    rec(1, np.array([[[5, 1]]]))  # back to the first layer: the next step
    rec(2, np.array([[[15, 11]]]))
    rec.close()
    trace = read_trace(path)
    assert trace.model == "org/m" and trace.steps == 2 and trace.tokens == 8
    assert trace.counts == rec.trace.counts
    assert trace.counts[(1, 1)] == 3 and trace.counts[(1, 2)] == 2 and trace.counts[(2, 11)] == 3
    lines = path.read_text().splitlines()
    assert json.loads(lines[1]) == {"step": 0, "layer": 1, "experts": [[1, 2], [2, 3], [1, 4]]}


def _record(path, model: str = "org/m", append: bool = True, calls: int = 2):  # type: ignore[no-untyped-def]
    rec = TraceRecorder(path, model, append=append)
    for step in range(calls):
        rec(1, np.array([[[step, 7]]]))
        rec(2, np.array([[[3, 4]]]))
    rec.close()
    return rec.trace


def test_recording_into_a_trace_appends_a_run_and_readers_sum_the_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.jsonl"
    first, second = _record(path), _record(path, calls=3)
    trace = read_trace(path)
    assert trace.counts == first.counts + second.counts and trace.steps == 2 + 3
    assert trace.tokens == 2 * (2 + 3) and trace.model == "org/m"
    headers = [line for line in path.read_text().splitlines() if '"format"' in line]
    assert len(headers) == 2
    _record(path, append=False)  # the library's default overwrites
    assert read_trace(path).steps == 2


def test_appending_drops_a_line_a_killed_run_cut_short(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.jsonl"
    whole = _record(path)
    with open(path, "a") as f:
        f.write('{"step": 2, "layer": 1, "exp')  # SIGKILL in the middle of a buffered write
    assert read_trace(path).counts == whole.counts  # a reader skips it
    again = _record(path)
    assert read_trace(path).counts == whole.counts + again.counts


def test_appending_refuses_another_models_trace_or_a_gzip_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.jsonl"
    _record(path)
    before = path.read_bytes()
    with pytest.raises(InvalidRequest, match="a trace of org/m, not org/other"):
        _record(path, model="org/other")
    assert path.read_bytes() == before
    with pytest.raises(InvalidRequest, match="gzip one once it is finished"):
        TraceRecorder(tmp_path / "t.jsonl.gz", "org/m", append=True)
    other = tmp_path / "not-a-trace.txt"
    other.write_text("my notes\n")
    with pytest.raises(InvalidRequest, match="not JSON"):
        TraceRecorder(other, "org/m", append=True)
    assert other.read_text() == "my notes\n"


def test_several_traces_and_gzip_ones_read_as_one_workload(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import gzip

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ta, tb = _record(a), _record(b, calls=1)
    packed = tmp_path / "b.jsonl.gz"
    packed.write_bytes(gzip.compress(b.read_bytes()))
    both = read_traces([a, packed])
    assert both.counts == ta.counts + tb.counts and both.steps == 3 and both.model == "org/m"
    _record(tmp_path / "c.jsonl", model="org/other")
    with pytest.raises(InvalidRequest, match="a trace of org/other among traces of org/m"):
        read_traces([a, tmp_path / "c.jsonl"])
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[:-12])
    with pytest.raises(InvalidRequest, match="cannot be read as a trace"):
        read_trace(cut)


@pytest.mark.parametrize("text,where", [
    ('{"format": "other"}\n', "not a cachecd-trace"),
    ('{"format": "cachecd-trace", "version": 1}\nnot json\n', ":2: not JSON"),
    ('{"format": "cachecd-trace", "version": 1}\n{"layer": 1}\n', ":2: a trace line needs"),
])
def test_bad_trace_names_the_line(tmp_path, text: str, where: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(InvalidRequest, match=where):
        read_trace(path)


def test_plan_batches_keep_priority_and_one_layer_each(m: Manifest) -> None:
    cached, access = _workload(m, 3)
    order = warm_order(m.sizes, cached, access)
    batches = plan_batches(m.layer_ids, m.expert_ids, m.sizes, order, max_experts=4, window=8)
    flat = [(b.layer, e) for b in batches for e in b.experts]
    assert sorted(flat) == sorted((int(m.layer_ids[r]), int(m.expert_ids[r])) for r in order)
    assert all(1 <= len(b.experts) <= 4 for b in batches)
    assert all(b.nbytes == sum(int(m.sizes[m.row(b.layer, e)]) for e in b.experts) for b in batches)
    # Everything of the first window of 8 is sent before anything of the second.
    first_window = {(int(m.layer_ids[r]), int(m.expert_ids[r])) for r in order[:8]}
    assert set(flat[:8]) == first_window


def test_fit_room() -> None:
    sizes = np.array([10, 10, 10])
    assert [fit_room(sizes, room) for room in (0, 9, 10, 25, 30, 1000)] == [0, 0, 1, 2, 3, 3]


def test_read_prompts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "p.txt"
    path.write_text('first prompt\n\n{"prompt": "second {json}"}\n  third\n')
    assert read_prompts(path) == ["first prompt", "second {json}", "  third"]
    path.write_text("\n\n")
    with pytest.raises(InvalidRequest, match="no prompts"):
        read_prompts(path)
    path.write_text('{"text": "x"}\n')
    with pytest.raises(InvalidRequest, match=":1:"):
        read_prompts(path)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_renderers(m: Manifest) -> None:
    cached, access = _workload(m, 4)
    report = coverage_report(m, cached, access)
    report["history"] = {"bucket_s": 60, "buckets": [{"t": 0, "hits": 3, "misses": 1}],
                         "hits": 3, "misses": 1}
    table = render_table(report)
    assert f"{report['experts_cached']} of 160 experts" in table
    assert all(f"\n{layer:>5} " in table for layer in m.moe_layers)
    assert json.loads(render_json(report)) == json.loads(json.dumps(report))
    shape = (len(m.moe_layers), m.experts_per_layer)
    png = render_png(report, Grid(list(m.moe_layers), cached.reshape(shape), access.reshape(shape)))
    width, height = _png_size(png)
    assert width >= 600 and height >= 200
    page = render_html(report, png)
    assert "http://" not in page and "https://" not in page
    assert "<table>" in page and "data:image/png;base64," in page
    assert page.count("<tr>") >= len(m.moe_layers) + 1
