"""``cachecd setup --stream ORG/NAME[@REV]``: install the resident model, register it, start a daemon.

Re-running is idempotent and resumes: files already present and verified are skipped, and the
resident file resumes from its progress record. Nothing of a routed expert is downloaded here:
the daemon fetches experts when routing first needs them. Next to another revision of the repo
registered with the daemon, it says what the new one reuses and copies what is unchanged
(``delta``); both stay registered. Which manifest it installs by is ``manifest_choice``'s, the
daemon it registers with (started if none runs) ``daemon_start``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any

from cachecd import constants
from cachecd.config import (
    MODELS_DIR_HELP,
    Settings,
    add_common_arguments,
    load_settings,
)
from cachecd.errors import (
    ManifestMismatch,
    Offline,
    XetProofError,
)
from cachecd.manifest.repo_ref import is_commit, parse_ref
from cachecd.manifest.sha256 import file_sha256
from cachecd.setup import lock, model_check, pipeline, preflight, record
from cachecd.setup.daemon_start import ensure_daemon
from cachecd.setup.delta import compare, copy_if_same, installed_before
from cachecd.setup.manifest_choice import choose_manifest
from cachecd.setup.resident import make_private
from cachecd.sizes import format_size

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    p = sub.add_parser("setup", help="install a model's resident weights and stream its experts")
    p.add_argument("--stream", required=True, metavar="ORG/NAME[@REV]", help="the model to stream")
    p.add_argument("--endpoint", help="Hub endpoint (default: $HF_ENDPOINT or huggingface.co)")
    add_common_arguments(p)
    p.add_argument("--manifest", metavar="FILE|hf://[datasets/]ORG/REPO/PATH[@REV]",
                   help="use this manifest (a file, or one published in a Hub repo; default: "
                        "the one cachecd ships for the model)")
    p.add_argument("--build-manifest", action="store_true",
                   help="build the manifest from the Hub (reads the whole revision once)")
    p.add_argument("--cache-dir", dest="cache_dirs", action="append", metavar="DIR",
                   help="cache dir for a daemon this command starts (repeatable; default: "
                        f"{constants.DEFAULT_CACHE_DIR})")
    p.add_argument("--budget", help="disk budget for a daemon this command starts (default: 0, "
                   "the free space)")
    p.add_argument("--models-dir", help=MODELS_DIR_HELP)
    p.add_argument("--share", metavar="HOST:PORT",
                   help="the daemon serves its verified experts to peers on HOST:PORT "
                        "(docs/sharing.md; default: off)")
    p.add_argument("--share-token-file", metavar="FILE",
                   help="with --share: the token peers must send (default: none; required "
                        "with --share)")
    p.add_argument("--peer", dest="peers", action="append", metavar="URL",
                   help="the daemon asks this peer's --share before the Hub (repeatable; "
                        "default: no peers)")
    p.add_argument("--peer-token-file", metavar="FILE",
                   help="with --peer: the token the peers' --share-token-file holds (default: "
                        "none; required with --peer)")
    p.add_argument("--no-start", action="store_true", help="do not start a daemon when none runs")
    p.add_argument("--pipeline", metavar="R/N",
                   help="install rank R of N machines that pipeline the model (mlx.launch): its "
                        "layers' resident weights, its daemon serving only its layers' experts "
                        "(default: the whole model on this machine)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="the tokenizer runs code its repo ships (Kimi's tokenization_kimi.py): "
                        "load it once now, as pinned by sha256 in the manifest")
    # Ctrl-C: cli says to run it again, which resumes (verified files kept, the resident file
    # from its progress record, a manifest build from its finished shards).
    p.set_defaults(func=run, resumes=True)
    p.epilog = ("What setup is told (--endpoint, --cache-dir, --models-dir, --budget, --share, "
                "--peer and their token files) is recorded beside the config file for the "
                "daemon on --socket: every later start of it (a bare `cachecd serve`, `cachecd "
                "service install`, the next setup) uses it unless CACHECD_* or a flag says "
                "otherwise (docs/daemon.md, Settings).")


_RECORDED_FLAGS = ("endpoint", "socket", "cache_dirs", "budget", "models_dir", "share",
                   "share_token_file", "peers", "peer_token_file")


def revision_names(rev: str, commit: str) -> list[str]:
    """The branch or tag ``rev`` names, for the daemon to take as a name of ``commit`` (none
    when ``rev`` is the commit or a prefix of it)."""
    return [] if commit.startswith(rev) else [rev]


def resolve_commit(repo: str, rev: str, endpoint: str, offline: bool,
                   models_dir: Path | None = None) -> str:
    if is_commit(rev):
        return rev
    if offline:
        return offline_commit(repo, rev, models_dir)
    from cachecd.manifest.hub_check import model_info  # its answer read within bounds

    return str(model_info(repo, rev, endpoint=endpoint, files=False).sha)


def offline_commit(repo: str, rev: str, models_dir: Path | None) -> str:
    """Offline, the Hub cannot say which commit a branch is: ``main`` (a revision not named) is
    the one revision installed, if exactly one is; anything else is refused, naming those."""
    base = models_dir / repo if models_dir is not None else None
    installed = sorted(p.name for p in base.iterdir() if is_commit(p.name)) \
        if base is not None and base.is_dir() else []
    if rev == "main" and len(installed) == 1:
        print(f"offline (HF_HUB_OFFLINE): {repo} is taken at {installed[0]}, the one revision "
              f"installed")
        return installed[0]
    have = f" (installed: {', '.join(installed)})" if installed else ""
    raise Offline(f"{repo}@{rev}: HF_HUB_OFFLINE is set, so the Hub cannot say which commit "
                  f"{rev!r} is; name the commit of a revision installed before "
                  f"(--stream {repo}@<40-hex commit>){have}, or unset HF_HUB_OFFLINE")


def fetch_small_files(manifest: Any, local: Path, endpoint: str,
                      reuse: Path | None = None) -> int:
    """Config, tokenizer and other non-weight files, each checked against the manifest's sha256;
    one with the same sha256 in ``reuse`` (another revision's install) is copied from there."""
    from huggingface_hub import hf_hub_download

    fetched = 0
    for info in manifest.files.values():
        if info.name.endswith(".safetensors"):
            continue
        target = local / info.name
        if target.exists() and file_sha256(target) == info.sha256:
            continue
        if reuse is not None and copy_if_same(reuse / info.name, target, info.sha256):
            continue
        path = Path(hf_hub_download(manifest.repo, info.name, revision=manifest.revision,
                                    endpoint=endpoint, local_dir=local))
        got = file_sha256(path)
        if got != info.sha256:
            path.unlink(missing_ok=True)
            raise ManifestMismatch(
                f"{manifest.source}: {info.name}: sha256 {info.sha256} in the manifest, {got} in "
                f"the bytes {endpoint} serves at {manifest.revision}: the manifest was altered or "
                f"not built from this commit; build one (cachecd manifest build "
                f"{manifest.key}) or get it again from its publisher")
        fetched += info.size
    return fetched



def check_tokenizer(manifest: Any, local: Path, trust: bool) -> bool:
    """Say which code files the repo has transformers run (every module an ``auto_map`` names),
    with the sha256 the manifest pins; with trust, load the tokenizer once now (under the installed
    transformers), before the resident weights come. True if the tokenizer needs that code."""
    from cachecd_engine.tokenizer import (
        describe,
        load_tokenizer,
        remote_code_files,
        tokenizer_runs_code,
    )

    files = remote_code_files(local)
    if not files:
        return False
    pins = {f.name: f.sha256 for f in manifest.files.values()}
    needed = tokenizer_runs_code(local)
    if not trust:
        who = "the tokenizer runs" if needed else "transformers runs, with trust,"
        print(f"{who} code from the repo: {describe(files, pins)}, pinned by the manifest; if you "
              f"trust it, pass --trust-remote-code to cachecd run, warm and openai "
              f"(trust_remote_code=True to cachecd_engine.load)")
        return needed
    tokenizer = load_tokenizer(local, None, trust_remote_code=True, pins=pins, repo=manifest.repo)
    print(f"tokenizer: ran {describe(files, pins)}: {tokenizer.vocab_size} ids, chat template "
          f"{'yes' if tokenizer.has_chat_template else 'no'}; cachecd run, warm and openai need "
          f"--trust-remote-code too")
    return needed


def text_model_tensors(manifest: Any, local: Path) -> set[str]:
    """The resident tensors mlx-lm's model keeps after its sanitize (names, shapes and dtypes
    only, asked of mlx-lm itself); says what is not installed."""
    import json

    from cachecd.setup.resident import skipped_summary
    from cachecd_engine.sanitize_keep import kept_names

    config = json.loads((local / "config.json").read_text())
    model_check.check_model_type(config, manifest.key)  # offline, the first config seen
    keep = kept_names(config, manifest.resident)
    skipped = [t for t in manifest.resident if t.name not in keep]
    if skipped:
        size = format_size(sum(t.nbytes for t in skipped))
        print(f"not installing {len(skipped)} tensors ({size}) that mlx-lm's "
              f"{manifest.model_type} model drops in its sanitize: "
              f"{skipped_summary([t.name for t in skipped], keep)}")
    return keep


async def fetch_resident(manifest: Any, local: Path, settings: Settings,
                         keep: set[str] | None = None, reuse: Path | None = None,
                         proven: bool = False) -> int:
    from huggingface_hub import get_token
    from huggingface_hub.utils import tqdm  # honours HF_HUB_DISABLE_PROGRESS_BARS

    from cachecd.setup.from_hub import share_kept
    from cachecd.setup.resident import ResidentWriter
    from cachecd.upstream.choose import open_upstream

    writer = ResidentWriter(manifest, local, keep, proven)
    if writer.done():
        return 0
    upstream = await asyncio.to_thread(open_upstream, settings, get_token())
    share_kept(upstream)
    total = writer.nbytes
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="resident weights", disable=None)

    async def fetch(file: str, start: int, end: int) -> bytearray:
        data = await upstream.fetch_range(manifest, file, start, end)
        proven = getattr(upstream.source, "proven", None)
        if writer.learns and not (proven is not None and proven(manifest, file)):
            raise XetProofError(f"{file} of {manifest.key}: served without an Xet hash, so its "
                                "resident tensors cannot be proven; pass --manifest or "
                                "--build-manifest")
        return data

    try:
        got = await writer.run(fetch, bar.update, reuse=reuse)
        if writer.disagree:
            print(f"the manifest ({manifest.source}) names other bytes than the Hub's, proven "
                  f"through Xet, for {len(writer.disagree)} resident tensors: "
                  f"{', '.join(writer.disagree[:4])}{' ...' if len(writer.disagree) > 4 else ''}"
                  "; the Hub's were installed, the manifest's word was not taken")
        if writer.repaired:
            print(f"repaired {len(writer.repaired)} resident tensors the install held with bytes "
                  f"the Hub did not vouch for: {', '.join(writer.repaired[:4])}"
                  f"{' ...' if len(writer.repaired) > 4 else ''}")
        return got
    finally:
        bar.close()
        await upstream.close()


def run(args: argparse.Namespace) -> int:
    given = {k: getattr(args, k, None) for k in _RECORDED_FLAGS}
    settings = load_settings(given)
    status = preflight.running(settings)
    if status is None and not args.no_start:
        preflight.check_writable(settings.cache_dirs)
    preflight.check_endpoint(settings, status)
    repo, rev = parse_ref(args.stream)
    with lock.model_lock(settings.models_dir, repo):
        return install(args, given, settings, status, repo, rev)


def install(args: argparse.Namespace, given: dict[str, Any], settings: Settings,
            status: dict[str, Any] | None, repo: str, rev: str) -> int:
    """The setup of ``repo@rev`` (``run``'s, under the model's lock)."""
    rank = pipeline.parse_rank(args.pipeline) if getattr(args, "pipeline", None) else None
    commit = resolve_commit(repo, rev, settings.endpoint, settings.offline, settings.models_dir)
    config = model_check.hub_config(repo, commit, settings.endpoint, settings.offline,
                                    settings.models_dir / repo / commit)
    if config is not None:  # before a manifest build reads the whole revision
        model_check.check_model_type(config, f"{repo}@{commit[:12]}")
    local = settings.models_dir / repo / commit
    if rank is not None:
        local = pipeline.rank_dir(local, *rank)
    manifest_path, manifest, origin = choose_manifest(args, repo, commit, settings, local)
    if origin == "headers":
        print(f"no manifest: {manifest.n_experts} experts mapped from the shards' headers, proven "
              f"through Xet against the Hub's hash of each shard at {commit[:12]}; config and "
              "tokenizer files checked against the commit's tree; each expert's digest is "
              "learnt from its proven bytes on its first fetch")
    elif origin not in ("built", "shipped"):
        print(f"its hashes are its maker's word ({manifest.made or 'how it was made is not recorded'}"
              f"): a wrong one makes the daemon refuse that expert's bytes (checksum_mismatch), "
              f"never serve them; --build-manifest makes them your own")
    make_private(settings.models_dir, repo)  # before any weight lands; fixes an older install
    local.mkdir(mode=0o700, parents=True, exist_ok=True)
    print(f"{repo}@{commit}: {manifest.n_experts} experts "
          f"({format_size(manifest.expert_bytes_total)}) streamed on demand")
    old = installed_before(settings.socket, repo, commit)
    old_dir = Path(old["local_dir"]) if old and old.get("local_dir") else None
    small = fetch_small_files(manifest, local, settings.endpoint, old_dir)
    remote_code = check_tokenizer(manifest, local, args.trust_remote_code)
    keep = text_model_tensors(manifest, local)
    layers = pipeline.rank_layers(local, *rank) if rank is not None else None
    preflight.check_budget(settings, status, manifest, local,
                           layers and (layers.start, layers.end))
    if layers is not None:
        keep = pipeline.rank_keep(manifest, keep, layers)
    delta = compare(settings.socket, old, manifest, keep) if old else None
    for line in delta.lines() if delta else []:
        print(line)
    reuse = delta.old_resident if delta else None
    model_check.check_room(local, model_check.resident_need(manifest, local, keep),
                           "the resident install", "pass --models-dir on a disk with room")
    from cachecd.setup.from_hub import on_xet_at  # aiohttp: only when setup runs

    proven = origin == "headers" or (not settings.offline and on_xet_at(
        repo, commit, settings.endpoint))
    resident = asyncio.run(fetch_resident(manifest, local, settings, keep, reuse, proven))
    make_private(settings.models_dir, repo)  # what hf_hub_download and copies wrote: 0600
    client = ensure_daemon(settings, args)
    with client:
        client.register(manifest_path, local, layers=layers and (layers.start, layers.end),
                        pipeline=rank, origin=origin, endpoint=settings.endpoint,
                        names=revision_names(rev, commit))
    if told := record.told(settings, given):
        print(f"recorded {', '.join(sorted(told))} for later starts of this daemon in "
              f"{record.record(settings.socket, told)}")
        if later := preflight.not_yet_running(settings, status, told):
            print(f"the daemon on {settings.socket} started before, so these apply from its next "
                  f"start (cachecd stop, then cachecd serve): {'; '.join(later)}")
    used = sum(f.stat().st_size for f in local.rglob("*") if f.is_file())
    full = sum(f.size for f in manifest.files.values())
    print(f"installed {local} ({format_size(used)} on disk, fetched {format_size(small + resident)} "
          f"now) of a {format_size(full)} model: {used / full:.1%}")
    trust = " --trust-remote-code" if remote_code else ""
    # With another revision registered beside it, a bare ORG/NAME no longer names one.
    name = f"{repo}@{rev if revision_names(rev, commit) else commit[:12]}" if old else repo
    if layers is not None:
        print(pipeline.rank_report(manifest, layers))
        print(f"run it on every machine at once: mlx.launch --hostfile hosts.json -- cachecd run "
              f"--model {name}{trust} --prompt 'Hello' --max-tokens 32")
        return 0
    print(f"run it: cachecd run --model {name}{trust} --prompt 'Hello' --max-tokens 32")
    return 0
