"""``cachecd manifest build`` and ``cachecd manifest verify``.

build: resolve REV to a commit, read every shard header, hash every shard once (checked against
the hub's sha256), ``--jobs`` at a time, resumably (``build``), write the manifest atomically.
verify: load + validate a manifest (a file or ``hf://...``), print a summary, and check it against
the endpoint's metadata and the shards' safetensors headers at its commit (``hub_check``); a
disagreement exits 1. ``--no-hub`` only validates the file.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from cachecd import constants, errors
from cachecd.manifest.repo_ref import is_commit, parse_ref
from cachecd.sizes import format_size

log = logging.getLogger(__name__)



def register(sub: Any) -> None:
    p = sub.add_parser("manifest", help="build or verify a model manifest")
    msub = p.add_subparsers(dest="manifest_command", metavar="SUBCOMMAND", required=True)
    b = msub.add_parser("build", help="build a manifest from a hub (one full pass over the shards)")
    b.add_argument("spec", metavar="ORG/NAME[@REV]", help="repo and revision (default: main)")
    b.add_argument("--endpoint", help="HF-compatible endpoint (default: HF_ENDPOINT)")
    b.add_argument("--token", help="HF token (default: HF_TOKEN or the stored login)")
    b.add_argument("--output", "-o", required=True, type=Path, help="manifest file to write")
    b.add_argument(
        "--from-dir", type=Path, help="read a local folder instead (REV must be a commit; default: read the hub)"
    )
    b.add_argument("--jobs", "-j", type=_jobs, default=constants.MANIFEST_BUILD_JOBS,
                   help="shards streamed and hashed at once (default: %(default)s)")
    b.add_argument("--work-dir", type=Path,
                   help="where finished shards are kept until the manifest is written, so a build "
                        "that stops resumes there (default: OUTPUT.parts)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=_build, resumes=True)  # finished shards are kept: a rerun resumes
    v = msub.add_parser("verify", help="check a manifest against the Hub and print a summary")
    v.add_argument("file", metavar="FILE|hf://...", help="a manifest file, or one published in a "
                   "Hub repo: hf://[datasets/]ORG/REPO/PATH[@REV]")
    v.add_argument("--endpoint", help="the endpoint whose commit it is checked against: the "
                   "files' sizes, the shards' sha256, the config's hash, and every expert's byte "
                   "ranges against the shards' safetensors headers (default: HF_ENDPOINT, "
                   f"{constants.HF_ENDPOINT})")
    v.add_argument("--token", help="HF token for --endpoint (default: HF_TOKEN or the stored "
                   "login)")
    v.add_argument("--no-hub", action="store_true",
                   help="only read and validate the file; checked against nothing, it proves "
                        "nothing about which bytes are which expert (default: check it)")
    v.set_defaults(func=_verify)


def _jobs(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number from 1 to 64")
    return int(text)


def _quiet_http(args: argparse.Namespace) -> None:
    if not getattr(args, "verbose", False):  # one line per HTTP request drowns the summary
        for name in ("httpx2", "httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _build(args: argparse.Namespace) -> int:
    _quiet_http(args)
    from cachecd.manifest.build import build_to_file
    from cachecd.manifest.source import HubSource, LocalSource

    repo, rev = parse_ref(args.spec)
    source: Any
    if args.from_dir is not None:
        if not is_commit(rev):
            raise errors.InvalidRequest("--from-dir needs ORG/NAME@COMMIT (40 hex)")
        source = LocalSource(args.from_dir, repo, rev)
    else:
        source = HubSource(repo, rev, endpoint=args.endpoint, token=args.token)
    progress = not args.no_progress and sys.stderr.isatty()
    manifest = build_to_file(source, args.output, progress=progress, jobs=args.jobs,
                             work_dir=args.work_dir, say=lambda m: print(m, file=sys.stderr))
    print(f"wrote {args.output}")
    _print_summary(manifest)
    return 0


MAX_SHOWN = 20  # disagreements printed; a manifest swapped throughout has one per expert


def _verify(args: argparse.Namespace) -> int:
    from cachecd.manifest import published
    from cachecd.manifest.manifest import Manifest

    endpoint = (args.endpoint or constants.HF_ENDPOINT).rstrip("/")
    path = args.file
    if published.is_published(str(args.file)):
        path, _ = published.fetch(str(args.file), endpoint=endpoint, token=args.token)
    manifest = Manifest.load(path)
    _print_summary(manifest)
    made = manifest.made
    print(f"made        {made}" if made else "made        (not recorded: an older cachecd)")
    if args.no_hub:
        print("ok: manifest valid (--no-hub: not checked against any endpoint)")
        return 0
    if constants.HF_HUB_OFFLINE:
        return _verify_offline(manifest, endpoint)
    _quiet_http(args)
    from cachecd.manifest.headers import keep_dir
    from cachecd.manifest.hub_check import problems

    found = problems(manifest, endpoint=endpoint, token=args.token,
                     keep=keep_dir(constants.DEFAULT_MODELS_DIR))
    for p in found[:MAX_SHOWN]:
        print(f"MISMATCH {p}")
    if len(found) > MAX_SHOWN:
        print(f"... and {len(found) - MAX_SHOWN} more")
    print(
        f"ok: manifest valid and matches the endpoint ({endpoint}): its files' sizes and "
        "sha256, the config's hash, and every expert's byte ranges against the shards' "
        "safetensors headers"
        if not found
        else f"FAILED: {len(found)} disagreement(s) with {endpoint} at {manifest.revision}"
    )
    return 0 if not found else 1


def _verify_offline(manifest: Any, endpoint: str) -> int:
    """HF_HUB_OFFLINE: the layout against headers ``endpoint`` served to an earlier check, if all
    are kept (another endpoint's are not its word)."""
    from cachecd.manifest.headers import keep_dir
    from cachecd.manifest.hub_check import check_layout_at

    keep = keep_dir(constants.DEFAULT_MODELS_DIR)
    try:
        check_layout_at(manifest, endpoint=endpoint, keep=keep, offline=True)
    except errors.Offline as exc:
        print(f"ok: manifest valid; not checked (HF_HUB_OFFLINE): {exc.message}")
        return 0
    print(f"ok: manifest valid; its layout matches the shards' headers kept in {keep} "
          "(HF_HUB_OFFLINE: the Hub's metadata not asked)")
    return 0


def _print_summary(m: Any) -> None:
    total = sum(f.size for f in m.files.values())
    layers = m.moe_layers
    span = f"{layers[0]}..{layers[-1]}" if layers else "-"
    print(f"repo        {m.repo}")
    print(f"revision    {m.revision}")
    print(f"model_type  {m.model_type} ({m.quant_format})")
    print(f"files       {len(m.files)} ({len(m.shards)} safetensors shards), {format_size(total)}")
    print(
        f"experts     {m.n_experts} = {len(layers)} MoE layers ({span}) x {m.experts_per_layer}, "
        f"{format_size(m.expert_bytes_total)}"
    )
    print(f"split       {m.split_experts} experts span two shards")
    print(f"resident    {len(m.resident)} tensors, {format_size(m.resident_bytes_total)}")
