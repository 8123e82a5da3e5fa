"""``cachecd coverage``: what of a model is local, what the workload would hit, what is missing.

The daemon answers with its own report plus the per-expert arrays (cached bits, access counts);
this command recomputes the report locally from those and the daemon's copy of the manifest, so
a ``--trace FILE`` workload is weighed with exactly the same code as the daemon's counts. Without
``--trace`` the numbers are the daemon's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cachecd.cli_help import count
from cachecd.config import add_common_arguments, load_settings
from cachecd.ctl import MODEL_HELP
from cachecd.errors import InvalidRequest
from cachecd.manifest.manifest import Manifest
from cachecd.report.coverage import access_array, coverage_report, unpack_detail
from cachecd.report.coverage_render import (
    FORMATS,
    Grid,
    render_html,
    render_json,
    render_png,
    render_table,
)

DAEMON_WORKLOAD = "the daemon's recorded accesses"


@dataclass
class Snapshot:
    """One model's cache state as the daemon sees it now."""

    manifest: Manifest
    cached: np.ndarray  # bool per manifest row
    access: np.ndarray  # the daemon's access count per manifest row
    history: dict[str, Any]
    layers: tuple[int, int] | None = None  # [start, end): the only layers the daemon serves
    pipeline: dict[str, int] | None = None  # {"rank", "size"} those layers are


def client_for(socket: str | None) -> Any:
    from cachecd_client import Client

    return Client(socket or load_settings().socket)


def snapshot(client: Any, model: str, manifest: Manifest | None = None) -> Snapshot:
    """The daemon's cached set and access counts; pass ``manifest`` to skip refetching it."""
    if manifest is None:
        manifest = Manifest.from_bytes(client.manifest_bytes(model), f"daemon:{model}")
    report = client.coverage(model, detail=True)
    cached, access = unpack_detail(report["detail"])
    if cached.size != manifest.n_experts:
        raise InvalidRequest(f"the daemon reported {cached.size} experts of {model}, the manifest "
                             f"has {manifest.n_experts}; was the model re-registered meanwhile?")
    served = report.get("served_layers")
    return Snapshot(manifest, cached, access, report.get("history") or {},
                    (int(served[0]), int(served[1])) if served else None, report.get("pipeline"))


def trace_access(manifest: Manifest, paths: list[str]) -> np.ndarray:
    """Per-row routed counts of recorded traces (``cachecd_engine.trace`` format, plain or
    gzip), summed over the files and the runs in each."""
    from cachecd_engine.trace import read_traces

    trace = read_traces(paths)
    if trace.model not in (None, manifest.repo):
        raise InvalidRequest(f"{', '.join(paths)}: traces of {trace.model}, not {manifest.repo}")
    return access_array(manifest, trace.counts)


def trace_label(paths: list[str]) -> str:
    return f"trace {paths[0]}" if len(paths) == 1 else f"traces {', '.join(paths)}"


def add_trace_flag(p: Any, helptext: str) -> None:
    """``--trace FILE [FILE ...]``, also repeatable: several traces are one workload."""
    p.add_argument("--trace", metavar="FILE", nargs="+", action="extend",
                   help=helptext + " (several files, or the flag repeated, add up; .gz is read too)")


def build_report(snap: Snapshot, access: np.ndarray, workload: str, top: int = 20) -> dict[str, Any]:
    report = coverage_report(snap.manifest, snap.cached, access, layers=snap.layers, top=top)
    report["workload"] = workload
    report["history"] = snap.history
    report["pipeline"] = snap.pipeline
    return report


def grid_of(manifest: Manifest, cached: np.ndarray, access: np.ndarray,
            layers: tuple[int, int] | None = None) -> Grid:
    shape = (len(manifest.moe_layers), manifest.experts_per_layer)
    keep = [i for i, layer in enumerate(manifest.moe_layers)
            if layers is None or layers[0] <= layer < layers[1]]
    return Grid([manifest.moe_layers[i] for i in keep], cached.reshape(shape)[keep],
                access.reshape(shape)[keep])


def register(sub: Any) -> None:
    p = sub.add_parser("coverage", help="per-layer coverage, workload hit rate, heatmap")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--format", choices=FORMATS, default="table", help="how to show it")
    # --json, as `cachecd status --json` takes it.
    p.add_argument("--json", dest="format", action="store_const", const="json",
                   help="the same as --format json")
    p.add_argument("--output", metavar="FILE",
                   help="write here instead of stdout (png needs it; default: stdout)")
    add_trace_flag(p, "weigh coverage by this routing trace (default: the daemon's counts)")
    p.add_argument("--top", type=count(1), default=20, help="how many most-wanted missing experts")
    add_common_arguments(p)
    p.set_defaults(func=coverage)


def coverage(args: argparse.Namespace) -> int:
    if args.format == "png" and not args.output:
        raise InvalidRequest("--format png writes an image: give --output FILE.png")
    from cachecd_client import resolve_model

    args.model = resolve_model(args.model, args.socket)
    with client_for(args.socket) as client:
        snap = snapshot(client, args.model)
    access, workload = snap.access, DAEMON_WORKLOAD
    if args.trace:
        access, workload = trace_access(snap.manifest, args.trace), trace_label(args.trace)
    report = build_report(snap, access, workload, args.top)
    data: str | bytes
    if args.format == "table":
        data = render_table(report) + "\n"
    elif args.format == "json":
        data = render_json(report) + "\n"
    else:
        png = render_png(report, grid_of(snap.manifest, snap.cached, access, snap.layers))
        data = png if args.format == "png" else render_html(report, png)
    if args.output:
        Path(args.output).write_bytes(data if isinstance(data, bytes) else data.encode())
        print(f"wrote {args.output} ({args.format})", file=sys.stderr)
    else:
        sys.stdout.write(data if isinstance(data, str) else data.decode())
    return 0
