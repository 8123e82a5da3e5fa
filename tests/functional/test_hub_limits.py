"""The Hub's limits at K3's scale, scaled down: signed URLs that expire (Xet's are presigned for
an hour) and a rate limit on /resolve (3,000 anonymous per 5 minutes). A cold session through the
daemon against `cachecd hub serve --url-ttl 4 --resolve-limit 3 --limit-window 2` resolves a
file again only once its URL expired, and never runs into the limit: it waits when the Hub's
RateLimit header says the window is spent."""

from __future__ import annotations

import re
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import pytest

from tests.harness import TINY_REPO, DaemonProcess, LoggedHub, expert_bytes_from_files, run_cli

TTL_S = 4
LIMIT, WINDOW_S = 3, 2
_LINE = re.compile(r"^(\S+ \S+) DEBUG \S+ request method=(\w+) path=(\S+) status=(\d+)")


def _resolves(hub: LoggedHub) -> list[tuple[float, str, int]]:
    """(time, file, status) of each /resolve the hub answered, from its log."""
    out = []
    for line in hub.log():
        m = _LINE.match(line)
        if m and "/resolve/" in m[3]:
            when = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((when, m[3].rsplit("/", 1)[-1], int(m[4])))
    return out


@pytest.mark.timeout(240)
def test_a_cold_session_re_resolves_only_expired_urls_and_stays_within_the_limit(
    hub_root: Path, tiny_manifest, tiny_manifest_path: Path, tiny_dir: Path  # type: ignore[no-untyped-def]
) -> None:
    # The LFS route's signed URLs (a file read through Xet is resolved once, for its hash).
    limits = ["--url-ttl", str(TTL_S), "--resolve-limit", str(LIMIT),
              "--limit-window", str(WINDOW_S), "--no-xet"]
    hub = LoggedHub(hub_root, limits)
    daemon = DaemonProcess(hub.url, [tiny_manifest_path], args=["--max-parallel", "1"]).start()
    try:
        layers = tiny_manifest.moe_layers
        with daemon.client(timeout=120) as c:
            for ids in ([0, 1], [2, 3]):
                for layer in layers:
                    for expert, got in zip(ids, c.experts(TINY_REPO, layer, ids), strict=True):
                        want = expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, expert))
                        assert got.tobytes() == want, (layer, expert)
                # The next batch starts after every URL resolved so far has expired.
                time.sleep(TTL_S + 1)
        resolves = _resolves(hub)
        refused = [r for r in resolves if r[2] == 429]
        assert not refused, f"{len(refused)} resolves answered 429: {refused[:5]}"
        # The layout check HEADs each shard once before any expert is served; the daemon's own
        # resolves follow, from the first file asked for a second time.
        names = [name for _, name, _ in resolves]
        split = next(i for i, name in enumerate(names) if name in names[:i])
        assert set(tiny_manifest.shards) <= set(names[:split])
        per_file: dict[str, list[float]] = defaultdict(list)
        for when, name, status in resolves[split:]:
            if status == 302:
                per_file[name].append(when)
        # Both batches needed the shards: some were resolved again in the second, their first
        # URL having expired, and never while a URL they held was still good (it lives TTL_S).
        again = [name for name, times in per_file.items() if len(times) > 1]
        assert again, per_file
        for name, times in per_file.items():
            gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
            assert all(g >= TTL_S / 2 for g in gaps), (name, gaps)
        # More resolves than one window allows: the session went through the limit, waiting.
        assert len(resolves) > 2 * LIMIT, resolves
    finally:
        daemon.cleanup()
        hub.stop()


def test_the_limit_options_refuse_what_cannot_be_a_limit(hub_root: Path) -> None:
    for flag in ("--resolve-limit", "--resolve-limit-signed", "--limit-window"):
        proc = run_cli("hub", "serve", str(hub_root), flag, "0", check=False, timeout=60)
        assert proc.returncode != 0 and f"{flag} must be positive, got 0" in proc.stderr
        assert "leave the limit out" in proc.stderr


def test_every_resolve_answer_carries_the_hubs_ratelimit_headers(hub_root: Path) -> None:
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import get_session, parse_ratelimit_headers

    hub = LoggedHub(hub_root, ["--resolve-limit", "2", "--resolve-limit-signed", "3"])
    try:
        url = hf_hub_url(TINY_REPO, "config.json", endpoint=hub.url.rstrip("/"))
        http = get_session()
        answers = [http.head(url, follow_redirects=False) for _ in range(3)]
        assert [a.status_code for a in answers] == [302, 302, 429]
        infos = [parse_ratelimit_headers(a.headers) for a in answers]
        assert [(i.remaining, i.limit, i.window_seconds) for i in infos if i] == [
            (1, 2, 300), (0, 2, 300), (0, 2, 300)]
        # A caller with a token is another caller, with the signed-in limit.
        signed = http.head(url, follow_redirects=False, headers={"Authorization": "Bearer t"})
        info = parse_ratelimit_headers(signed.headers)
        assert signed.status_code == 302 and info and (info.remaining, info.limit) == (2, 3)
    finally:
        hub.stop()
