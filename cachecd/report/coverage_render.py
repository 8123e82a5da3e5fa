"""Coverage reports for people: a terminal table, JSON, a PNG heatmap, a self-contained HTML page.

Every renderer takes the dict ``coverage.coverage_report`` builds (plus ``history`` and
``workload`` keys the coverage command adds); the heatmap also takes the per-expert grid.
Invariants: the HTML page references nothing outside itself (the heatmap is an inline base64
PNG, styles are inline), so it can be mailed or archived; matplotlib runs on the Agg backend
and is imported only when a PNG is asked for.
"""

from __future__ import annotations

import base64
import html
import io
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachecd.sizes import format_size

FORMATS = ("table", "json", "png", "html")


@dataclass
class Grid:
    """Per-expert state as a (layers x experts) picture."""

    layers: list[int]
    cached: np.ndarray  # bool, (n_layers, experts_per_layer)
    access: np.ndarray  # int, same shape


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def summary_lines(report: dict[str, Any]) -> list[str]:
    exp_share = report["experts_cached"] / report["experts_total"] if report["experts_total"] else 0
    workload = report.get("workload", "the daemon's recorded accesses")
    lines = [
        f"model      {report['repo']}@{report['revision'][:12]}",
        *_served_line(report),
        (f"cached     {report['experts_cached']} of {report['experts_total']} experts "
         f"({exp_share:.1%}), {format_size(report['bytes_cached'])} of "
         f"{format_size(report['bytes_total'])}"),
        (f"workload   expected hit rate {_pct(report['workload_coverage'])} "
         f"({report['accesses']} accesses from {workload})"),
    ]
    hist = report.get("history")
    if hist:
        asked = hist["hits"] + hist["misses"]
        rate = _pct(hist["hits"] / asked) if asked else "n/a"
        lines.append(f"history    {hist['hits']} hits, {hist['misses']} misses ({rate}) in "
                     f"{len(hist['buckets'])} buckets of {hist['bucket_s']} s since the daemon started")
    return lines


def _served_line(report: dict[str, Any]) -> list[str]:
    """What a registration restricted to some layers (a pipeline rank's) covers, if it is."""
    served = report.get("served_layers")
    if not served:
        return []
    rank = report.get("pipeline")
    of = f" (pipeline rank {rank['rank']} of {rank['size']})" if rank else ""
    return [f"serves     layers {served[0]}-{served[1] - 1} only{of}: the figures below are "
            f"these layers' experts"]


def _reach_line(row: dict[str, Any]) -> str:
    if row["bytes_more"] is None:
        return f"  {row['target']:.0%}: no recorded workload"
    return f"  {row['target']:.0%}: +{format_size(row['bytes_more'])} ({row['experts_more']} experts)"


def render_table(report: dict[str, Any]) -> str:
    lines = summary_lines(report)
    header = (f"{'layer':>5} {'cached':>7} {'total':>6} {'bytes cached':>13} {'bytes total':>12} "
              f"{'accesses':>9} {'hit rate':>8}")
    lines += ["", header]
    for row in report["layers"]:
        lines.append(f"{row['layer']:>5} {row['experts_cached']:>7} {row['experts_total']:>6} "
                     f"{format_size(row['bytes_cached']):>13} {format_size(row['bytes_total']):>12} "
                     f"{row['accesses']:>9} {_pct(row['workload_coverage']):>8}")
    lines += ["", "to reach an expected hit rate of"] + [_reach_line(r) for r in report["to_reach"]]
    if report["most_wanted"]:
        lines += ["", "most wanted missing experts (layer/expert: accesses)"]
        lines.append("  " + ", ".join(f"{w['layer']}/{w['expert']}: {w['accesses']}"
                                      for w in report["most_wanted"]))
    buckets = (report.get("history") or {}).get("buckets") or []
    if buckets:
        lines += ["", "recent hits/misses"]
        for b in buckets[-10:]:
            stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(b["t"]))
            lines.append(f"  {stamp}  {b['hits']:>7} hits {b['misses']:>7} misses")
    return "\n".join(lines)


def render_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=1)


def render_png(report: dict[str, Any], grid: Grid, dpi: int = 100) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    n_layers, per = grid.cached.shape
    height = max(3.0, min(12.0, 2.0 + n_layers * 0.06))
    fig, axes = plt.subplots(1, 2, figsize=(14, height), sharey=True, constrained_layout=True)
    try:
        extent = (-0.5, per - 0.5, n_layers - 0.5, -0.5)
        axes[0].imshow(grid.cached, aspect="auto", interpolation="nearest", cmap="Greens",
                       vmin=0, vmax=1, extent=extent)
        axes[0].set_title(f"cached: {report['experts_cached']} of {report['experts_total']}")
        freq = axes[1].imshow(np.log10(1 + grid.access.astype(np.float64)), aspect="auto",
                              interpolation="nearest", cmap="magma", extent=extent)
        axes[1].set_title(f"accesses (log10 1+n), hit rate {_pct(report['workload_coverage'])}")
        fig.colorbar(freq, ax=axes[1], shrink=0.8)
        ticks = np.linspace(0, n_layers - 1, min(n_layers, 12)).round().astype(int)
        axes[0].set_yticks(ticks, [str(grid.layers[i]) for i in ticks])
        axes[0].set_ylabel("layer")
        for ax in axes:
            ax.set_xlabel("expert")
        fig.suptitle(f"{report['repo']}@{report['revision'][:12]}")
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return buf.getvalue()


_CSS = ("body{font-family:system-ui,sans-serif;margin:2em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:2px 8px;"
        "text-align:right}th{background:#f4f4f4}img{max-width:100%}pre{background:#f8f8f8;padding:1em}")


def _html_table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report: dict[str, Any], png: bytes | None) -> str:
    title = f"cachecd coverage: {report['repo']}@{report['revision'][:12]}"
    layers = _html_table(
        ["layer", "experts cached", "experts total", "bytes cached", "bytes total", "accesses",
         "hit rate"],
        [[r["layer"], r["experts_cached"], r["experts_total"], format_size(r["bytes_cached"]),
          format_size(r["bytes_total"]), r["accesses"], _pct(r["workload_coverage"])]
         for r in report["layers"]])
    reach = _html_table(["expected hit rate", "bytes more", "experts more"],
                        [[f"{r['target']:.0%}", "n/a" if r["bytes_more"] is None
                          else format_size(r["bytes_more"]), r["experts_more"]]
                         for r in report["to_reach"]])
    wanted = _html_table(["layer", "expert", "accesses", "bytes"],
                         [[w["layer"], w["expert"], w["accesses"], format_size(w["bytes"])]
                          for w in report["most_wanted"]])
    img = ("" if png is None else
           f'<img alt="heatmap" src="data:image/png;base64,{base64.b64encode(png).decode()}">')
    summary = html.escape("\n".join(summary_lines(report)))
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1><pre>{summary}</pre>"
            f"{img}<h2>Per layer</h2>{layers}<h2>To reach a hit rate</h2>{reach}"
            f"<h2>Most wanted missing experts</h2>{wanted}</body></html>\n")
