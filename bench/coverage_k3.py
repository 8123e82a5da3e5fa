"""Bench: a coverage report at Kimi K3 scale (82,432 experts), goal <= 1 s.

Uses the synthetic K3-shaped manifest of bench/manifest_load.py, a skewed workload (per layer,
a Zipf popularity over 896 experts in a random order; ~1.5M routed accesses), and a cached set
of about 30% of the experts, mostly the popular ones (what an LFU cache converges to). Times,
as medians over runs:

- the daemon's part: cached_mask (one ``has`` per expert against a dict of cached digests, as
  the store does), access_array (from the index's {(layer, expert): (count, last)} form),
  coverage_report and pack_detail (the ``?detail=1`` arrays);
- the command's part: unpack_detail, coverage_report again, render_table and render_json;
- separately: render_png (matplotlib, 92 x 896 heatmaps; the first call, with the matplotlib
  import, apart) and render_html;
- separately: reading the access counts from a real LMDB index with a row per used expert.

Not a test: it prints numbers; the last line is ``report_s=X`` (daemon part + command part).
Usage: python bench/coverage_k3.py [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# The synthetic K3 manifest comes from the sibling bench script, importable once its dir is on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from manifest_load import synthetic_k3

from cachecd.manifest.manifest import Manifest
from cachecd.report.coverage import (
    access_array,
    cached_mask,
    coverage_report,
    pack_detail,
    unpack_detail,
)
from cachecd.report.coverage_render import Grid, render_html, render_json, render_png, render_table
from cachecd.store.blobs import validate_digest


def workload(
    m: Manifest, seed: int = 0
) -> tuple[dict[tuple[int, int], tuple[int, float]], set[str]]:
    rng = np.random.default_rng(seed)
    per = m.experts_per_layer
    weights = 1.0 / np.arange(1, per + 1) ** 1.1
    counts: dict[tuple[int, int], tuple[int, float]] = {}
    cached_rows = []
    for i, layer in enumerate(m.moe_layers):
        popularity = np.empty(per)
        popularity[rng.permutation(per)] = weights / weights.sum()
        n = rng.poisson(16_000 * popularity)  # ~16k routed accesses per layer
        for e in np.flatnonzero(n):
            counts[(layer, int(e))] = (int(n[e]), 1.7e9 + float(e))
        noisy = n * rng.lognormal(0.0, 0.5, per)
        cached_rows.extend(i * per + np.argsort(-noisy)[: int(per * 0.3)])
    return counts, {m.digest_hex(int(r)) for r in cached_rows}


def median_time(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(runs):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def lmdb_read_s(m: Manifest, counts: dict[tuple[int, int], tuple[int, float]], runs: int) -> float:
    from cachecd.store.index import Index

    with tempfile.TemporaryDirectory(prefix="cdbench") as tmp:
        index = Index(Path(tmp) / "index.lmdb", flush_every=1 << 30, flush_interval=3600)
        try:
            for (layer, expert), (n, last) in counts.items():
                digest = m.digest_hex(m.row(layer, expert))
                for _ in range(min(n, 3)):  # the count does not change the read; rows do
                    index.record_access(digest, m.key, layer, expert, last)
            index.flush_access()
            seconds, got = median_time(lambda: index.access_counts(m.key), runs)
            assert len(got) == len(counts)
        finally:
            index.close()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    m = synthetic_k3()
    counts, cached_set = workload(m)
    entries = dict.fromkeys(cached_set)

    def has(digest_hex: str) -> bool:  # what Store.has does
        return validate_digest(digest_hex) in entries

    def daemon_part() -> dict[str, Any]:
        cached, access = cached_mask(m, has), access_array(m, counts)
        report = coverage_report(m, cached, access)
        report["detail"] = pack_detail(cached, access)
        return report

    def command_part(wire: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
        cached, access = unpack_detail(wire["detail"])
        report = coverage_report(m, cached, access)
        return render_table(report), render_json(report), report

    mask_s, cached = median_time(lambda: cached_mask(m, has), args.runs)
    access_s, access = median_time(lambda: access_array(m, counts), args.runs)
    cov_s, _ = median_time(lambda: coverage_report(m, cached, access), args.runs)
    daemon_s, wire = median_time(daemon_part, args.runs)
    command_s, (table, text, report) = median_time(lambda: command_part(wire), args.runs)
    shape = (len(m.moe_layers), m.experts_per_layer)
    grid = Grid(list(m.moe_layers), cached.reshape(shape), access.reshape(shape))
    png_first_s, _ = median_time(lambda: render_png(report, grid), 1)  # includes the import
    png_s, png = median_time(lambda: render_png(report, grid), args.runs)
    html_s, page = median_time(lambda: render_html(report, png), args.runs)
    print(
        f"experts={m.n_experts} cached={report['experts_cached']} "
        f"bytes_cached={report['bytes_cached']} used_experts={len(counts)} "
        f"accesses={report['accesses']} workload_coverage={report['workload_coverage']:.4f}"
    )
    print(f"to_reach={[(r['target'], r['bytes_more']) for r in report['to_reach']]}")
    print(f"cached_mask_s={mask_s:.4f} access_array_s={access_s:.4f} coverage_report_s={cov_s:.4f}")
    print(
        f"daemon_part_s={daemon_s:.4f} command_part_s={command_s:.4f} "
        f"table_chars={len(table)} json_chars={len(text)}"
    )
    print(
        f"png_first_s={png_first_s:.3f} png_s={png_s:.3f} png_bytes={len(png)} html_s={html_s:.4f} html_bytes={len(page)}"
    )
    print(f"lmdb_access_counts_s={lmdb_read_s(m, counts, args.runs):.4f}")
    print(f"report_s={daemon_s + command_s:.3f}")


if __name__ == "__main__":
    main()
