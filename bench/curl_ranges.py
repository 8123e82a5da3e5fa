"""Baseline for the cold bench: curl fetching byte ranges in parallel from the same endpoint.

Each file is resolved once (a HEAD to ``/resolve``, no redirect followed, as cachecd does), then
every range is a separate curl transfer to the signed Location, ``--parallel-max`` at a time, into
/dev/null. Every transfer must come back 206 with exactly the asked length, or the run fails:
a baseline that silently got less data would flatter nothing and mislead everyone.

Library: ``resolve_locations(...)`` and ``curl_ranges(...) -> CurlResult``. Script:
``python bench/curl_ranges.py ENDPOINT MANIFEST [--layer N] [--parallel 8]`` prints the numbers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

GIB = float(1 << 30)


@dataclass(frozen=True)
class CurlResult:
    transfers: int
    nbytes: int
    seconds: float

    @property
    def gib_s(self) -> float:
        return self.nbytes / GIB / self.seconds if self.seconds > 0 else 0.0


def resolve_locations(
    endpoint: str, repo: str, revision: str, files: Iterable[str], token: str | None = None
) -> dict[str, str]:
    """file -> signed Location (or the resolve URL itself when the endpoint serves directly)."""
    out: dict[str, str] = {}
    for file in files:
        url = f"{endpoint.rstrip('/')}/{repo}/resolve/{revision}/{file}"
        cmd = ["curl", "-sS", "-I", "-o", "/dev/null", "-w", "%{http_code} %{redirect_url}", url]
        if token:
            cmd[1:1] = ["-H", f"Authorization: Bearer {token}"]
        code, _, location = subprocess.run(
            cmd, check=True, capture_output=True, text=True
        ).stdout.partition(" ")
        if code not in ("200", "301", "302", "307", "308"):
            raise RuntimeError(f"resolve {file}: HTTP {code}")
        out[file] = location.strip() or url
    return out


def curl_ranges(jobs: Sequence[tuple[str, int, int]], parallel: int = 8) -> CurlResult:
    """Fetch every (url, start, end-exclusive) with ``curl --parallel``; check status and size."""
    with tempfile.NamedTemporaryFile("w", suffix=".curlrc") as cfg:
        # Options in a config file are global unless each transfer is its own `next` group.
        cfg.write(
            "next\n".join(
                f'url = "{url}"\nrange = "{start}-{end - 1}"\noutput = "/dev/null"\n'
                'header = "Accept-Encoding: identity"\n'
                'write-out = "%{http_code} %{size_download}\\n"\n'
                for url, start, end in jobs
            )
        )
        cfg.flush()
        cmd = ["curl", "-sS", "--parallel", "--parallel-max", str(parallel), "-K", cfg.name]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
    lines = [ln.split() for ln in proc.stdout.splitlines() if ln.strip()]
    want = sorted(end - start for _, start, end in jobs)
    got = sorted(int(size) for code, size in lines if code == "206")
    if got != want:
        raise RuntimeError(f"curl: {len(got)}/{len(jobs)} transfers were exact 206 answers")
    return CurlResult(len(jobs), sum(want), seconds)


def main() -> int:
    from cachecd.manifest.manifest import Manifest

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("endpoint")
    ap.add_argument("manifest")
    ap.add_argument("--layer", type=int, default=None, help="one MoE layer (default: the first)")
    ap.add_argument("--parallel", type=int, default=8)
    args = ap.parse_args()
    m = Manifest.load(args.manifest)
    layer = m.moe_layers[0] if args.layer is None else args.layer
    ranges = [r for e in range(m.experts_per_layer) for r in m.expert(layer, e).ranges]
    locations = resolve_locations(args.endpoint, m.repo, m.revision, {r.file for r in ranges})
    res = curl_ranges([(locations[r.file], r.start, r.end) for r in ranges], args.parallel)
    print(f"transfers={res.transfers} bytes={res.nbytes} seconds={res.seconds:.3f}")
    print(f"gib_s={res.gib_s:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
