"""``cachecd doctor``: what this machine gives a streamed model, measured in under a minute.

Per cache dir: cold reads of expert-sized blocks at queue depths 1-32 and the page cache's rate
(``disk_probe``); free memory, swap and the pool the engine would take by default (``host``);
MLX's backend and device; with ``--network``, the endpoint's resolve time and one range's
rate (``network_probe``). A table for people, ``--json`` for scripts and for ``cachecd plan
--doctor FILE``. Reads and writes only its own temp files, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

from cachecd import constants
from cachecd.config import load_settings, parse_size
from cachecd.errors import InvalidRequest
from cachecd.sizes import format_size

DOCTOR_FORMAT = "cachecd-doctor"
DOCTOR_VERSION = 1
DEFAULT_SIZE = "1GiB"


def register(sub: Any) -> None:
    p = sub.add_parser("doctor", help="measure this machine: disk reads, memory, MLX, network")
    p.add_argument("--cache-dir", action="append", metavar="DIR",
                   help="a cache dir to measure, repeatable (default: CACHECD_CACHE_DIRS or the "
                        f"config's cache_dirs, else {constants.DEFAULT_CACHE_DIR})")
    p.add_argument("--size", default=DEFAULT_SIZE,
                   help="the temp file read at each queue depth, per cache dir")
    p.add_argument("--block", default=str(_block_default()),
                   help="the read size (default: one Kimi K3 expert, 17,547,264 bytes)")
    p.add_argument("--network", metavar="REPO[@REV]",
                   help="also time a resolve and one range of this repo's largest shard (default: no "
                        "network figures)")
    p.add_argument("--endpoint", default=None,
                   help=f"the endpoint --network asks (default: HF_ENDPOINT, {constants.HF_ENDPOINT})")
    p.add_argument("--socket", help="a running daemon's socket, for its round trip (default: "
                   "CACHECD_SOCKET or the config's; none running: not measured)")
    p.add_argument("--json", action="store_true", help="print JSON (what plan --doctor reads)")
    p.set_defaults(func=doctor)


def _block_default() -> int:
    from cachecd.plan.disk_probe import K3_EXPERT_BYTES

    return K3_EXPERT_BYTES


def doctor(args: argparse.Namespace) -> int:
    dirs = load_settings({"cache_dirs": args.cache_dir}).cache_dirs
    report = measure([str(d) for d in dirs], parse_size(args.size, "--size"),
                     parse_size(args.block, "--block"), args.network,
                     args.endpoint or constants.HF_ENDPOINT, args.socket)
    print(json.dumps(report, indent=1) if args.json else render_table(report))
    return 0


def measure(dirs: list[str], size: int, block: int, network: str | None = None,
            endpoint: str = constants.HF_ENDPOINT, socket: str | None = None) -> dict[str, Any]:
    from cachecd.plan.daemon_probe import probe_daemon
    from cachecd.plan.disk_probe import probe_dir
    from cachecd.plan.host import memory_figures, mlx_figures

    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "format": DOCTOR_FORMAT, "version": DOCTOR_VERSION, "created": round(time.time(), 3),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpus": _cpus(), "memory": memory_figures(), "mlx": mlx_figures(),
        "disks": [probe_dir(d, size, block).to_json() for d in dirs],
        "daemon": probe_daemon(socket), "network": None}
    if network:
        from cachecd.plan.network_probe import probe_network

        repo, _, rev = network.partition("@")
        report["network"] = probe_network(endpoint, repo, rev or None)
    report["elapsed_s"] = round(time.perf_counter() - t0, 3)
    return report


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_report(path: str) -> dict[str, Any]:
    """A doctor's JSON (``cachecd doctor --json > FILE``); ``InvalidRequest`` if it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except FileNotFoundError:
        raise InvalidRequest(f"{path}: no such file (write one with cachecd doctor --json > "
                             f"{path})") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"{path}: not a doctor's JSON ({exc})") from None
    if not isinstance(report, dict) or report.get("format") != DOCTOR_FORMAT:
        raise InvalidRequest(f"{path}: not a {DOCTOR_FORMAT} file (write one with cachecd doctor "
                             "--json)")
    if report.get("version") != DOCTOR_VERSION or not report.get("disks"):
        raise InvalidRequest(f"{path}: a {DOCTOR_FORMAT} v{report.get('version')} file without "
                             f"disks; this cachecd reads v{DOCTOR_VERSION}: run cachecd doctor again")
    return report


def _rate(x: float | None) -> str:
    return "-" if not x else f"{x / 1e9:.2f} GB/s"


def render_table(report: dict[str, Any]) -> str:
    mem, mlx = report["memory"], report["mlx"]
    swap = (f"swap {format_size(mem['swap_used_bytes'])} used of "
            f"{format_size(mem['swap_total_bytes'])}" if mem["swap_total_bytes"] is not None
            else "swap unknown")
    lines = [f"machine    {report['platform']}, {report['cpus']} CPUs",
             f"memory     {format_size(mem['total_bytes'])}, {format_size(mem['available_bytes'])}"
             f" available, {swap}",
             f"pool       {format_size(mem['default_pool_bytes'])} (the engine's default here)",
             f"mlx        {mlx.get('version', '?')}, backend {mlx.get('backend', mlx.get('error'))}"
             f", {mlx.get('device', '')} {mlx.get('device_info', {}).get('device_name', '')}"]
    for d in report["disks"]:
        lines += ["", f"cache dir  {d['path']}: {format_size(d['free_bytes'])} free; reads of "
                  f"{format_size(d['block_bytes'])}; cold reads: {d['method']}",
                  "  queue depth  " + "".join(f"{qd:>11}" for qd in d["cold"]),
                  "  cold         " + "".join(f"{_rate(v):>11}" for v in d["cold"].values()),
                  f"  page cache   {_rate(d['page_cache'])} (4 readers)"]
    daemon = report.get("daemon")
    lines += ["", "daemon     " + (
        f"{daemon['socket']}: one expert of {format_size(daemon['expert_bytes'])} in "
        f"{daemon['request_s'] * 1e3:.2f} ms, {daemon['per_expert_s'] * 1e3:.2f} ms more "
        "each in a request of several" if daemon else
        "none answered with a cached expert: its round trip is not measured")]
    net = report.get("network")
    if net:
        lines += ["", f"network    {net['endpoint']} {net['repo']}: resolve "
                  f"{net['resolve_s'] * 1e3:.1f} ms, one range of {format_size(net['range_bytes'])}"
                  f" {_rate(net['range_rate'])} (first byte {net['first_byte_s'] * 1e3:.1f} ms)"]
    lines.append(f"\nmeasured in {report['elapsed_s']:.1f} s; cachecd doctor --json > FILE "
                 "keeps it for cachecd plan --doctor FILE")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit("run it as: cachecd doctor")
