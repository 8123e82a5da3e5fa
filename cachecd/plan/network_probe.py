"""The endpoint as the daemon will use it: how long a resolve takes (the HEAD that gives a
file's commit, size and signed location) and how fast one exact range streams from that
location.

Uses huggingface_hub for the URL, the token and the headers (``hf_hub_url``,
``get_hf_file_metadata``, ``build_hf_headers``, ``HF_ENDPOINT``), as the upstream client does;
the token never goes to a host other than the endpoint's.
"""

from __future__ import annotations

import statistics
import time
from typing import Any
from urllib.parse import urlsplit

RANGE_BYTES = 64 << 20
RESOLVES = 3


def probe_network(endpoint: str, repo: str, revision: str | None = None,
                  filename: str | None = None, range_bytes: int = RANGE_BYTES) -> dict[str, Any]:
    import huggingface_hub as hf

    revision = revision or "main"
    filename = filename or _largest_shard(endpoint, repo, revision)
    url = hf.hf_hub_url(repo, filename, revision=revision, endpoint=endpoint)
    times, meta = [], None
    for _ in range(RESOLVES):
        t0 = time.perf_counter()
        meta = hf.get_hf_file_metadata(url)
        times.append(time.perf_counter() - t0)
    assert meta is not None and meta.location
    n = min(range_bytes, int(meta.size or range_bytes))
    first, total = _one_range(endpoint, meta.location, n)
    return {"endpoint": endpoint, "repo": repo, "revision": meta.commit_hash or revision,
            "file": filename, "resolve_s": statistics.median(times), "range_bytes": n,
            "first_byte_s": first, "range_s": total, "range_rate": n / total if total else 0.0}


def _largest_shard(endpoint: str, repo: str, revision: str) -> str:
    import huggingface_hub as hf

    files = [f for f in hf.HfApi(endpoint=endpoint).list_repo_tree(repo, revision=revision,
                                                                   recursive=True)
             if getattr(f, "size", None) and f.path.endswith(".safetensors")]
    if not files:
        raise FileNotFoundError(f"{repo}@{revision} has no .safetensors file at {endpoint}")
    return max(files, key=lambda f: getattr(f, "size", 0)).path


def _one_range(endpoint: str, location: str, n: int) -> tuple[float, float]:
    """(seconds to the first byte, seconds to the last) of ``bytes=0-{n-1}``; a reply other
    than 206 with exactly that range is an error, as it is to the daemon."""
    import huggingface_hub as hf

    same_host = urlsplit(location).netloc == urlsplit(endpoint).netloc
    headers = {**(hf.utils.build_hf_headers() if same_host else {}),
               "Range": f"bytes=0-{n - 1}", "Accept-Encoding": "identity"}
    t0 = time.perf_counter()
    first, got = 0.0, 0
    with hf.get_session().stream("GET", location, headers=headers, follow_redirects=True) as r:
        if r.status_code != 206 or not r.headers.get("content-range", "").startswith(
                f"bytes 0-{n - 1}/"):
            raise OSError(f"{location}: a range request got HTTP {r.status_code} "
                          f"({r.headers.get('content-range')!r}), not 206 with bytes 0-{n - 1}")
        for chunk in r.iter_bytes(1 << 20):
            first = first or time.perf_counter() - t0
            got += len(chunk)
    total = time.perf_counter() - t0
    if got != n:
        raise OSError(f"{location}: the range ended after {got} of {n} bytes")
    return first, total
