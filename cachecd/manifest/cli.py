"""``cachecd manifest build`` and ``cachecd manifest verify``.

build: resolve REV to a commit, read every shard header, hash every shard once (checked against
the hub's sha256), ``--jobs`` at a time, resumably (``build``), write the manifest atomically.
verify: load + validate a manifest (a file or ``hf://...``) and print a summary; with --endpoint,
compare it with the hub's metadata for its commit (``hub_check``).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path
from typing import Any

from cachecd import constants, errors

log = logging.getLogger(__name__)

SPEC_RE = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w.-]+))?")


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
    b.set_defaults(func=_build)
    v = msub.add_parser("verify", help="validate a manifest and print a summary")
    v.add_argument("file", metavar="FILE|hf://...", help="a manifest file, or one published in a "
                   "Hub repo: hf://[datasets/]ORG/REPO/PATH[@REV]")
    v.add_argument("--endpoint", help="also check it against this endpoint's metadata for its "
                   "commit (files' sizes, the shards' sha256, the config's hash; default: no "
                   "check; an hf:// FILE comes from HF_ENDPOINT)")
    v.add_argument("--token", help="HF token for --endpoint (default: HF_TOKEN or the stored "
                   "login)")
    v.set_defaults(func=_verify)


def _jobs(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number from 1 to 64")
    return int(text)


def parse_spec(spec: str) -> tuple[str, str]:
    """``org/name[@rev]`` -> (repo, rev); rev defaults to "main"."""
    m = SPEC_RE.fullmatch(spec)
    if m is None or ".." in spec:
        raise errors.InvalidRequest(f"{spec!r} is not ORG/NAME[@REV]")
    return m.group("repo"), m.group("rev") or "main"


def _quiet_http(args: argparse.Namespace) -> None:
    if not getattr(args, "verbose", False):  # one line per HTTP request drowns the summary
        for name in ("httpx2", "httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _build(args: argparse.Namespace) -> int:
    _quiet_http(args)
    from cachecd.manifest.build import build_to_file
    from cachecd.manifest.source import HubSource, LocalSource

    repo, rev = parse_spec(args.spec)
    source: Any
    if args.from_dir is not None:
        if not re.fullmatch(r"[0-9a-f]{40}", rev):
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


def _verify(args: argparse.Namespace) -> int:
    from cachecd.manifest import published
    from cachecd.manifest.manifest import Manifest

    path = args.file
    if published.is_published(str(args.file)):
        endpoint = args.endpoint or constants.HF_ENDPOINT
        path, _ = published.fetch(str(args.file), endpoint=endpoint, token=args.token)
    manifest = Manifest.load(path)
    _print_summary(manifest)
    if args.endpoint is None:
        print("ok: manifest valid")
        return 0
    _quiet_http(args)
    from cachecd.manifest.hub_check import problems

    found = problems(manifest, endpoint=args.endpoint.rstrip("/"), token=args.token)
    for p in found:
        print(f"MISMATCH {p}")
    print(
        "ok: manifest valid and matches the endpoint"
        if not found
        else f"FAILED: {len(found)} disagreement(s) with the endpoint's metadata"
    )
    return 0 if not found else 1


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    return f"{n} B"


def _print_summary(m: Any) -> None:
    total = sum(f.size for f in m.files.values())
    layers = m.moe_layers
    span = f"{layers[0]}..{layers[-1]}" if layers else "-"
    print(f"repo        {m.repo}")
    print(f"revision    {m.revision}")
    print(f"model_type  {m.model_type} ({m.quant_format})")
    print(f"files       {len(m.files)} ({len(m.shards)} safetensors shards), {_human(total)}")
    print(
        f"experts     {m.n_experts} = {len(layers)} MoE layers ({span}) x {m.experts_per_layer}, "
        f"{_human(m.expert_bytes_total)}"
    )
    print(f"split       {m.split_experts} experts span two shards")
    print(f"resident    {len(m.resident)} tensors, {_human(m.resident_bytes_total)}")
