"""Render docs/RELIABILITY.md from the figures one full run of tests/faults measured.

The file is generated: every number in it comes from ``figures.FIGURES`` as filled by that run.
``python -m tests.faults.write_report`` is not a thing on purpose: there is nothing to render
without a run (``pytest tests/faults --reliability-report docs/RELIABILITY.md`` writes it from its
session-finish hook; without the option nothing is written).
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.faults.figures import Figures

SCENARIOS: dict[str, tuple[str, str]] = {
    "s01": ("kill -9 mid-write", "restart works; temps removed, bad rows dropped; next request "
            "serves manifest bytes; fsync(tmp) < rename < fsync(dir) < LMDB commit"),
    "s02": ("hub sends wrong bytes", "checked before commit; nothing reaches index or final path; "
            "bounded refetch then 502; no bad byte served across 1,000 requests"),
    "s03": ("truncated body / RST", "bounded retries; temp deleted; reservation released; "
            "fds and tasks back to baseline"),
    "s04": ("stall / timeout", "read timeout fires within setting + 1 s; total deadline; "
            "504 upstream_timeout retryable; /healthz < 100 ms throughout (the daemon's own "
            "time: see the note on health_own_max_ms)"),
    "s05": ("429 / 5xx storm", "no request within 2 s of a 429 (Retry-After: 2); peak in flight "
            "<= limit; 401/403/404 not retried"),
    "s06": ("same expert, many clients", "64 clients: one upstream GET, same bytes; on failure "
            "the same error and the next request fetches again; disconnect does not cancel"),
    "s07": ("disk budget", "blobs never over budget (+ reservations); hot set kept; too_large at "
            "once; reservations_full 507; smaller budget evicts before accepting; fds survive "
            "eviction"),
    "s08": ("disk full (ENOSPC)", "507 disk_full, temp removed, cached entries served, a fetch "
            "succeeds after space is freed without a restart"),
    "s09": ("LMDB map full", "a 64 KiB map grows under load; kill -9 during growth reopens "
            "cleanly"),
    "s10": ("bit rot / missing blob / stray", "fsck exit bitmask (1 corrupt, 4 unverifiable); "
            "--fast sizes only; repair then refetch good bytes; open drops missing/short blobs"),
    "s11": ("socket perms and peer uid", "0700 dir and 0600 socket before the first accept; "
            "EACCES for uid 65534; 403 + log line when modes are widened; stale socket rules; "
            "second daemon exits non-zero"),
    "s12": ("path traversal", "typed 4xx before any I/O (hub sees 0 requests); symlinks refused"),
    "s13": ("malformed / abusive requests", "typed 4xx only, no 500, no traceback; health "
            "< 100 ms (the daemon's own time); bounded connections and RSS"),
    "s14": ("bad manifest", "manifest_invalid naming file and field; that model refused, others "
            "served"),
    "s15": ("shutdown, restart, client", "SIGTERM drains in-flight fetches within "
            "shutdown_timeout, exit 0; DaemonUnavailable < 100 ms (the client's own time); "
            "retries after restart"),
    "s16": ("secrets, hostile endpoints", "no Hub or LAN token in any log, stderr or error body; "
            "a hostile hub's or peer's answer refuses that model only, in one line; reads "
            "bounded (gzip bomb, 200,000-deep JSON, stalled body); redirects off the web "
            "refused; the socket answers while start checks stall"),
    "s17": ("soak", "decode-shaped clients, warm/status/coverage/evict, a tight budget, the "
            "scrub and a faulty upstream for the soak's length: no wrong byte served, budget "
            "held, the scrub finds nothing, RSS/fds/tasks do not grow after warm-up"),
}


# Shown under "Limits this run measured" when the figure is present and truthy.
NOTES: dict[str, str] = {
    "s01.answered_before_a_crash_point": (
        "A verified miss is answered from its temp file while the blob's commit runs, so at a "
        "crash point on the write path the client may already hold its (verified) bytes when "
        "the daemon dies; the restart removes the temp or adopts the stray, and fetches again "
        "where needed."),
    "s10.rotted_hits_served_before_scrub_verdict": (
        "A blob whose bytes rot in place (same length) while the daemon holds it open is served "
        "on hits as it is until the background scrub reaches it: the zero-copy hit path does "
        "not re-hash. The scrub hashes every blob in turn at --scrub-rate (default 4 MiB/s), so "
        "the window is at most one pass (cache bytes / rate; 4 days for a full K3 cache at the "
        "default); from the scrub's verdict on the blob is never handed out "
        "(s10.rotted_hits_served_after_scrub_verdict), and it is fetched again on next use. "
        "Rot at rest is caught sooner: a blob the daemon did not commit itself is hashed on its "
        "first open, and any blob again at its first open a day (REVERIFY_AFTER_S) after its "
        "last hash (s10.rot_caught_on_reverify, with the day shortened). `cachecd fsck` finds "
        "either (exit 1) and `--repair` quarantines it; missing and short blobs are caught on "
        "open and refetched."),
    "s13.slowloris_connections": (
        "The control socket holds at most MAX_CONTROL_CONNECTIONS (128): a connection that "
        "arrives at the limit pushes out the oldest one that never started a request, or else "
        "the one kept alive idle longest if that is 1 s or more (IDLE_CLOSE_AFTER_S; "
        "s13.idle_connections_closed_for_newcomers). When every one has a request under way "
        "or was answered within that second, the newcomer gets a typed 503 too_many_connections "
        "(cachecd.daemon.control_door). A client that leaves mid-request is a debug line, not a "
        "traceback. A half-sent request that is not pushed out is closed by "
        "aiohttp's keep-alive timer after 75 s. The data socket admits at most MAX_CONNECTIONS "
        "(256). Both sockets are 0600, same-uid only."),
    "all.health_own_max_ms": (
        "The 100 ms bars on /healthz (s04, s13) and on DaemonUnavailable (s15) are checked on "
        "the daemon's (the client's) own time: each probe's wall time less the time the probe "
        "and the daemon's event-loop thread spent runnable but waiting for a CPU, the larger of "
        "the two (Linux schedstat run delay; the two may overlap, so their sum could hide a "
        "held loop and is not used; the loop's only when it was asleep as the probe began). Until 2026-12-05 the bar was on wall time, which a loaded "
        "machine misses while the daemon does nothing wrong (111 ms wall, 43 ms own, seen with "
        "six busy loops beside s04); a loop held by a blocking call, a stopped daemon or the GIL "
        "counts in full (test_s04_stall.py::test_the_health_bar_sees_a_held_loop). The wall "
        "figures are kept: health_max_ms, daemon_unavailable_ms_max."),
    "s17.disk_samples_torn": (
        "The disk samplers (s07, s17) walk tmp/ and blobs/ in a process of their own; a walk "
        "during which a file it counted went away (an eviction) is dropped, not kept as a "
        "sample (disk_samples_torn): it may count the evicted blob beside the one that took its "
        "place, bytes never on the disk at once (4.57 MB over s17's 4 MiB budget was seen that "
        "way on a loaded machine). A kept walk counted only files that all existed at its end."),
    "s17.hit_latency_p99_ms": (
        "The soak's latencies are measured on this 2-core machine shared with the test process, "
        "which checks every byte it is served (xxh3) and runs the fake hub: they describe this "
        "run under load, not the daemon alone (bench/hits.py and bench/overhead.py measure "
        "that)."),
}


def _outcomes(fig: Figures, sid: str) -> tuple[int, int, list[str]]:
    passed, failed, skipped = 0, 0, []
    for node, outcome in sorted(fig.outcomes.items()):
        if f"/test_{sid}_" not in node:
            continue
        if outcome == "passed":
            passed += 1
        elif outcome.startswith("skipped"):
            skipped.append(f"`{node.split('::', 1)[-1]}`: {outcome[9:]}")
        else:
            failed += 1
    return passed, failed, skipped


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".")
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value).replace("|", "\\|")


def _short(node: str) -> str:
    """``test_sNN_x.py::test[param]``: the path dropped, a parameter with a / in it kept."""
    path, _, test = node.partition("::")
    return f"{path.rsplit('/', 1)[-1]}::{test}"


def _figure(fig: Figures, sid: str, key: str, value: Any) -> str:
    shown = f"{key} = {_fmt(value)}"
    return shown + " (setting)" if fig.is_setting(f"{sid}.{key}") else shown


def _git_head(root: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


def render(fig: Figures, wall_seconds: float, root: Path) -> str:
    lines = [
        "# Reliability: measured",
        "",
        "Generated by `pytest tests/faults --reliability-report docs/RELIABILITY.md` "
        "(tests/faults/conftest.py, session finish) from the "
        "figures that run measured. Do not edit by hand; run the suite again. The scenarios and "
        "their pass criteria are in docs/fault-scenarios.md. Every figure was counted, sampled "
        "or timed by that run, except those marked (setting): values the tests chose.",
        "",
        f"- run: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, commit {_git_head(root)}, "
        f"{platform.system()} {platform.release()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        f"- fault suite wall time: {wall_seconds:.1f} s",
        "",
        "| # | scenario | tests passed / failed | criterion | measured |",
        "|---|---|---|---|---|",
    ]
    skipped_all: list[str] = []
    for sid, (title, criterion) in SCENARIOS.items():
        passed, failed, skipped = _outcomes(fig, sid)
        skipped_all += [f"{sid}: {s}" for s in skipped]
        measured = "; ".join(_figure(fig, sid, k, v) for k, v in fig.scenario(sid).items()) or "-"
        state = f"{passed} / {failed}" + (f" ({len(skipped)} skipped)" if skipped else "")
        lines.append(f"| {sid[1:]} | {title} | {state} | {criterion} | {measured} |")
    lines += ["", "## Global invariant, over the whole run", ""]
    lines += [f"- {_figure(fig, 'all', k, v)}" for k, v in fig.scenario("all").items()]
    lines += ["", "## Limits this run measured", ""]
    lines += [f"- {text}" for key, text in NOTES.items() if fig.get(key)] or ["- none"]
    lines += ["", "## Skipped", ""]
    lines += [f"- {s}" for s in skipped_all] or ["- none"]
    lines += ["", "## Tests", ""]
    lines += [f"- `{_short(node)}`: {outcome}" for node, outcome in sorted(fig.outcomes.items())]
    return "\n".join(lines) + "\n"


def write_report(path: Path, fig: Figures, wall_seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(render(fig, wall_seconds, Path(__file__).resolve().parents[2]))
    os.replace(tmp, path)
