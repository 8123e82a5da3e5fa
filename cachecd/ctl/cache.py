"""Commands that ask a running daemon: ``status``, ``pin``, ``unpin``, ``evict``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from cachecd.config import add_common_arguments, load_settings, parse_size
from cachecd.ctl import MODEL_HELP
from cachecd.errors import EXIT_BUSY, FSCK_UNVERIFIABLE, CachecdError, CacheLocked
from cachecd.sizes import format_size


def _client(args: argparse.Namespace) -> Any:
    from cachecd_client import Client

    return Client(args.socket or load_settings().socket)


def _experts_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--layer", type=int, required=True, help="the MoE layer's number")
    p.add_argument("--experts", required=True, help="comma-separated expert numbers, e.g. 0,5,17")


def _ids(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="daemon health, models, disk use, hit rate")
    add_common_arguments(p)
    p.add_argument("--json", action="store_true", help="print the raw status JSON")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="list each model's pinned experts by layer")
    p.set_defaults(func=status)
    for name, helptext in (("pin", "fetch and pin experts so they are never evicted"),
                           ("unpin", "let pinned experts be evicted again")):
        p = sub.add_parser(name, help=helptext)
        add_common_arguments(p)
        _experts_args(p)
        p.set_defaults(func=pin if name == "pin" else unpin)
    p = sub.add_parser("evict", help="free cache space by policy, or evict given experts")
    add_common_arguments(p)
    p.add_argument("--bytes", default="0", help="how much to free by policy, e.g. 10GB")
    p.add_argument("--model", help="ORG/NAME of --experts (default: the one model the daemon "
                   "has registered)")
    p.add_argument("--layer", type=int, help="the MoE layer of --experts (default: none)")
    p.add_argument("--experts", default="",
                   help="comma-separated expert numbers to evict, e.g. 0,5,17 (default: none)")
    p.set_defaults(func=evict, usage_error=p.error)
    p = sub.add_parser("fsck", help="verify every cached blob (daemon stopped); exit 1 corrupt, "
                       "4 unverifiable, 6 a daemon holds the cache")
    p.add_argument("--cache-dir", dest="cache_dirs", action="append", metavar="DIR",
                   help="cache dir (repeat for each); default: the configured ones")
    p.add_argument("--fast", action="store_true", help="check sizes only")
    p.add_argument("--repair", action="store_true",
                   help="quarantine corrupt blobs and drop their rows (refetched on next use)")
    p.add_argument("--incremental", action="store_true", help="resume the last interrupted pass")
    p.add_argument("--all", action="store_true", help="a full pass from the start (the default)")
    p.set_defaults(func=fsck)


def status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = client.stats(verbose=args.verbose or args.json)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(render_status(info))
    return 0


def render_status(info: dict[str, Any]) -> str:
    store = info.get("store", {})
    counters = info.get("counters", {})
    requests = counters.get("expert_requests", 0)
    hits = counters.get("expert_hits", 0)
    budget = store.get("budget", 0)
    lines = [
        f"daemon      pid {info['pid']}, up {info['uptime_s']:.0f}s, version {info['version']}",
        f"socket      {info['socket']}",
        f"endpoint    {info['endpoint']}{' (offline)' if info.get('offline') else ''}",
        f"cache       {', '.join(info['cache_dirs'])}",
        f"models      {info.get('models_dir', '?')}",
        f"disk use    {format_size(store.get('bytes', 0))} in {store.get('entries', 0)} experts"
        + (f" of a {format_size(budget)} budget" if budget else " (no budget: free space)"),
        f"hit rate    {hits / requests:.1%} of {requests} expert requests" if requests
        else "hit rate    no expert requests yet",
        f"in flight   {info.get('inflight', 0)} fetches",
    ]
    if "scrub" in info:
        lines += _scrub_lines(info["scrub"])
    lines += _sharing_lines(info)
    for m in info.get("models", []):
        names = f" ({', '.join(m['names'])})" if m.get("names") else ""
        lines.append(f"model       {m['repo']}@{m['revision'][:12]}{names} {m['experts_total']} "
                     f"experts, {format_size(m['expert_bytes_total'])} of experts")
        if m.get("layers"):
            rank = m.get("pipeline")
            of = f" (pipeline rank {rank['rank']} of {rank['size']})" if rank else ""
            lines.append(f"  serves    layers {m['layers'][0]}-{m['layers'][1] - 1} only{of}: "
                         f"{m['experts_served']} experts, {format_size(m['expert_bytes_served'])}")
        if "experts_cached" in m:
            lines.append(_cached_line(m))
        lines += _pinned_lines(m)
        if "manifest_origin" in m:
            lines.append(manifest_line(m))
        if "route" in m:
            lines.append(route_line(m["route"]))
        lines += endpoint_lines(m, info)
    for repo, why in info.get("refused_models", {}).items():
        lines.append(f"refused     {repo}: {why}")
    lines += _attention(store, counters, info.get("scrub"))
    return "\n".join(lines)


def endpoint_lines(model: dict[str, Any], info: dict[str, Any]) -> list[str]:
    """A model installed from another endpoint than the daemon's, and what that means."""
    theirs, here = model.get("endpoint"), str(info.get("endpoint") or "")
    if not theirs or theirs.rstrip("/") == here.rstrip("/"):
        return []
    allowed = (info.get("settings") or {}).get("allow_other_endpoint")
    then = ("its missing experts are fetched from this daemon's endpoint "
            "(--allow-other-endpoint)" if allowed else
            "its missing experts are NOT fetched (endpoint_mismatch): run the daemon with "
            f"--endpoint {theirs}, or --allow-other-endpoint")
    return [f"  endpoint  installed from {theirs}, not {here}: {then}"]


def _sharing_lines(info: dict[str, Any]) -> list[str]:
    """--share's served/refused and each --peer's state (skipped after wrong bytes)."""
    lines = []
    share, up = info.get("share"), info.get("upstream", {})
    if share:
        refused = sum(v for k, v in share.items() if k.startswith("refused_"))
        closed = sum(v for k, v in share.items()
                     if k.startswith("connections_") and k != "connections_refused")
        lines.append(f"sharing     {share.get('served_experts', 0)} experts "
                     f"({format_size(share.get('served_bytes', 0))}) served to peers, "
                     f"{refused} refused; connections {share.get('connections', 0)} of "
                     f"{share.get('connection_limit', 0)}, {closed} closed by the door, "
                     f"{share.get('connections_refused', 0)} turned away")
    for peer in info.get("peers", []):
        lines.append(f"peer        {peer['url']} {_peer_state(peer)}")
    if info.get("peers"):
        lines.append(f"  from peers {up.get('peer_experts', 0)} experts, "
                     f"{format_size(up.get('peer_bytes', 0))}; {up.get('peer_lies', 0)} times "
                     "wrong bytes")
    return lines


def _peer_state(peer: dict[str, Any]) -> str:
    """Skipped (down, wrong bytes, too slow), down (its last request failed, its skip over: it is
    asked at the next miss), or asked first."""
    if peer["skipped_for_s"]:
        why = peer.get("skipped_because") or "it served wrong bytes"
        state = f"SKIPPED for {peer['skipped_for_s']:.0f}s more: {why}"
        if why.startswith("down: ") and "down_because" in peer:
            n = peer.get("down_faults_in_a_row", 1)
            state += (f" (down for {peer['down_for_s']:.0f}s, {n} fault{'s' * (n != 1)} in a "
                      "row); the Hub serves meanwhile (check it, or --peer)")
        return state
    if "down_because" in peer:
        return (f"DOWN for {peer['down_for_s']:.0f}s: {peer['down_because']}; asked again at "
                f"the next miss (check it, or --peer)")
    return "asked before the Hub"


def manifest_line(m: dict[str, Any]) -> str:
    """Where a model's manifest came from, how it was made, and whether its layout is checked."""
    origin, made = m.get("manifest_origin"), m.get("manifest_made")
    if origin == "built":
        how = "built on this machine by a full pass: its hashes are the revision's own"
    elif origin == "shipped":
        how = "shipped with cachecd"
    elif origin == "headers":
        how = ("none: the expert map from the shards' headers proven through Xet, each expert's "
               "digest learnt from its proven bytes on its first fetch")
    else:
        how = (f"{origin or 'registered without saying where it came from'}, made "
               f"{made or '(not recorded)'} by its maker's word: a wrong hash is refused, never "
               f"served; `setup --build-manifest` makes them your own")
    layout = ("layout checked against the shards' headers" if m.get("layout_checked") else
              "layout NOT checked yet: no expert is served until it is")
    return f"  manifest  {how}; {layout}"


_ROUTES = {
    "xet": "Xet: each range proven against the Hub's own hash of its file at the commit",
    "lfs": "LFS: exact Range requests, each expert checked against the manifest's xxh3",
    "xet+lfs": "Xet where the Hub keeps the file there (proven against its hash), LFS for the "
               "others (the manifest's xxh3)",
}


def route_line(route: str | None) -> str:
    """How a model's bytes are read from the Hub (docs/streaming.md)."""
    return "  route     " + _ROUTES.get(route or "", "decided at its first fetch since the daemon "
                                         "started (Xet where the Hub keeps the file there)")


def _cached_line(m: dict[str, Any]) -> str:
    """A model's coverage: its experts cached, of those this daemon serves."""
    served, total = m.get("experts_served", m["experts_total"]), m.get(
        "expert_bytes_served", m["expert_bytes_total"])
    share = m["expert_bytes_cached"] / total if total else 0.0
    return (f"  cached    {m['experts_cached']}/{served} experts, "
            f"{format_size(m['expert_bytes_cached'])} of {format_size(total)} ({share:.1%})")


def _pinned_lines(m: dict[str, Any]) -> list[str]:
    """A model's pinned experts: how many and their bytes; by layer when asked (--verbose)."""
    if not m.get("experts_pinned"):
        return []
    lines = [f"  pinned    {m['experts_pinned']} experts, {format_size(m['expert_bytes_pinned'])}: "
             f"never evicted (`cachecd unpin` lets them go)"]
    by_layer: dict[int, list[int]] = {}
    for layer, expert in m.get("pinned", []):
        by_layer.setdefault(layer, []).append(expert)
    lines += [f"    layer {layer}: {', '.join(map(str, experts))}"
              for layer, experts in sorted(by_layer.items())]
    return lines


def _ago(when: float) -> str:
    seconds = max(0.0, time.time() - when)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _scrub_lines(scrub: dict[str, Any]) -> list[str]:
    """The background scrub: this pass's progress, the last full pass, what it found."""
    if not scrub.get("rate"):
        return ["scrub       off (--scrub-rate 0): rot under a running daemon waits for "
                "`cachecd fsck`"]
    now = scrub.get("pass") or {}
    if "resting_until" in scrub:  # every blob scrubbed: the thread sleeps (store/scrub.py)
        left = max(0.0, scrub["resting_until"] - time.time())
        lines = [f"scrub       resting: every cached blob scrubbed; the next pass starts when "
                 f"a blob comes in, or in {left / 60:.0f} min"]
    else:
        lines = [f"scrub       pass {scrub.get('passes', 0) + 1}: {now.get('blobs_done', 0)}/"
                 f"{now.get('blobs_total', 0)} blobs, {format_size(now.get('bytes_done', 0))} "
                 f"of {format_size(now.get('bytes_total', 0))}, at {format_size(scrub['rate'])}/s"]
    last = scrub.get("last_pass")
    lines.append(f"last scrub  full pass {_ago(last['finished'])} ({last['blobs']} blobs in "
                 f"{last['seconds']:.0f} s), {last['failures']} failed their hash" if last
                 else "last scrub  no full pass yet")
    lines.append(f"scrubbed    {scrub.get('blobs', 0)} blobs, "
                 f"{format_size(scrub.get('bytes', 0))} since start; "
                 f"{scrub.get('failures', 0)} failed their hash, {scrub.get('missing', 0)} "
                 "missing or short")
    return lines


def _attention(store: dict[str, Any], counters: dict[str, Any],
               scrub: dict[str, Any] | None = None) -> list[str]:
    """Lines for what the user should look into, from the counters since the daemon started."""
    out = []
    if rot := (scrub or {}).get("failures", 0):
        out.append(f"attention   {rot} cached experts failed their hash in the background scrub "
                   "(bit rot): quarantined, fetched again on next use; check the disk, then "
                   "`cachecd fsck`")
    if rot := store.get("bit_rot_on_open", 0):
        out.append(f"attention   {rot} cached experts failed their hash when opened (bit rot): "
                   "quarantined and fetched again; check the disk, then `cachecd fsck`")
    if rot := store.get("bit_rot_on_read", 0):
        out.append(f"attention   {rot} cached experts failed their hash as the engine read them "
                   "(bit rot): quarantined and fetched again; check the disk, then `cachecd fsck`")
    if refused := counters.get("control_connections_refused", 0):
        out.append(f"attention   {refused} control connections were refused: the daemon held "
                   "its limit of connections, each busy or just answered (`ss -xp | grep cachecd`)")
    return out


def _model(args: argparse.Namespace) -> str:
    from cachecd_client import resolve_model

    return resolve_model(args.model, args.socket)


def pin(args: argparse.Namespace) -> int:
    args.model = _model(args)
    with _client(args) as client:
        n = client.pin(args.model, args.layer, _ids(args.experts))
    print(f"pinned {n} experts of {args.model} layer {args.layer}")
    return 0


def unpin(args: argparse.Namespace) -> int:
    args.model = _model(args)
    with _client(args) as client:
        n = client.unpin(args.model, args.layer, _ids(args.experts))
    print(f"unpinned {n} experts of {args.model} layer {args.layer}")
    return 0


def evict(args: argparse.Namespace) -> int:
    if args.experts and args.layer is None:
        args.usage_error("--experts needs --layer: the MoE layer those experts are in")
    if args.experts:
        args.model = _model(args)
    with _client(args) as client:
        report = client.evict_report(parse_size(args.bytes, "--bytes"), args.model, args.layer,
                                     _ids(args.experts))
    line = f"freed {format_size(report['freed_bytes'])}"
    if report.get("pinned"):
        line += (f"; {report['pinned']} of those experts are pinned, so kept: `cachecd unpin "
                 f"--model {args.model} --layer {args.layer} --experts {args.experts}` first")
    print(line)
    return 0


def fsck(args: argparse.Namespace) -> int:
    from huggingface_hub.utils import tqdm  # honours HF_HUB_DISABLE_PROGRESS_BARS

    from cachecd.store.fsck import fsck as run_fsck

    try:
        dirs = load_settings({"cache_dirs": args.cache_dirs}).cache_dirs
    except CachecdError as exc:  # a bad config: nothing was checked
        print(f"cachecd: {exc.code}: {exc.message}", file=sys.stderr)
        return FSCK_UNVERIFIABLE
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:  # checking would make an empty cache there and call it clean
        print(f"cachecd: fsck: no cache dir at {', '.join(missing)}: give the --cache-dir the "
              "daemon uses (cachecd status names them)", file=sys.stderr)
        return FSCK_UNVERIFIABLE
    bar = tqdm(unit="blob", desc="fsck", disable=None)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        report = run_fsck(dirs, fast=args.fast, repair=args.repair,
                          incremental=args.incremental and not args.all, progress=progress)
    except CacheLocked as exc:  # busy, not corrupt: scripts must tell the two apart
        print(f"cachecd: {exc.code}: {exc.message}; fsck checks a stopped daemon's cache (a "
              "running one re-hashes its blobs in the background: cachecd status)",
              file=sys.stderr)
        return EXIT_BUSY
    except OSError as exc:  # the cache itself cannot be opened: nothing could be verified
        print(f"cachecd: fsck cannot open the cache ({exc.strerror}: {exc.filename}); "
              "run it as the user that owns the cache dir", file=sys.stderr)
        return FSCK_UNVERIFIABLE
    except CachecdError as exc:  # anything else that stops the check: nothing was verified
        print(f"cachecd: {exc.code}: {exc.message}", file=sys.stderr)
        return FSCK_UNVERIFIABLE
    finally:
        bar.close()
    for issue in report.corrupt + report.unverifiable:
        state = " (repaired)" if issue.repaired else ""
        print(f"{issue.kind:<13} {issue.digest} {issue.detail}{state}")
    print(report.summary())
    return report.exit_code
