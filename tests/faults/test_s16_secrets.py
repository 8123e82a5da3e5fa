"""Scenario 16: secret hygiene. Every daemon of this suite runs with a token-shaped HF_TOKEN and
DEBUG logs, and every log and error body is grepped for ``hf_[A-Za-z0-9]{30,}`` (the pool does it
at teardown; ``all.secrets_found`` is the suite-wide count). Here: the token goes to /resolve
only, never to the CDN URL; a refused token (401) does not echo it; /v1/status and /metrics do
not show it."""

from __future__ import annotations

import functools
import stat
import subprocess
import time
import tracemalloc
import zlib
from pathlib import Path

import pytest

from cachecd.errors import CachecdError, Unauthorized
from tests.faults.figures import FIGURES
from tests.faults.hubs import HostileHub, ScriptedPeer
from tests.faults.support import (
    FAKE_TOKEN,
    SECRET_RE,
    FaultDaemon,
    Model,
    build_model,
    fetch_verified,
    http_request,
)
from tests.harness import plant, run_cli, short_tmp


def test_token_only_to_resolve_and_never_echoed(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    hub.faults.require_token = FAKE_TOKEN
    d = pool.daemon(hub, [small])
    first, second = small.entry(small.layers[0], 0), small.entry(small.layers[-1], 31)
    assert first.ranges[0].file != second.ranges[0].file
    with d.client() as c:
        fetch_verified(c, small, first.layer, [first.expert])
        hub.faults.require_token = "hf_" + "Other" * 7  # the daemon's token is now refused
        with pytest.raises(Unauthorized) as info:
            fetch_verified(c, small, second.layer, [second.expert])
    assert not SECRET_RE.search(info.value.message)
    auth = [(r.kind, r.headers.get("Authorization")) for r in hub.records]
    assert ("resolve_head", f"Bearer {FAKE_TOKEN}") in auth
    assert all(a is None for kind, a in auth if kind.startswith("cdn")), auth
    FIGURES.set("s16.cdn_requests_with_a_token", sum(1 for k, a in auth if k.startswith("cdn") and a))
    for path in ("/v1/status", "/metrics", "/v1/models"):
        _, _, body = http_request(d.socket, "GET", path)
        found = SECRET_RE.findall(body.decode("utf-8", "replace"))
        FIGURES.add("all.secrets_found", len(found))
        assert not found, path
    FIGURES.setting("s16.token_in_env",
                    f"hf_ + {len(FAKE_TOKEN) - 3} chars, DEBUG logs, every daemon of the suite")


# -- a hostile peer, a hostile hub: planted tokens, bounded reads, refusals of one model ---------
LAN_TOKEN = "5ec2e7" + "0123456789abcdef" * 3 + "c0ffee0123"  # 64 hex: 256 bits, as config wants
plant(LAN_TOKEN, FAKE_TOKEN)  # every daemon's log and stderr is searched at its cleanup


@pytest.fixture(scope="module")
def evil(fault_root: Path) -> Model:
    """Another repo with the small model's very bytes: what a hostile endpoint says about it
    must cost that model alone."""
    return build_model(fault_root, "faults/evil")


def _hostile(pool, small: Model, evil: Model):  # type: ignore[no-untyped-def]
    t = pool.hub_thread(small, HostileHub)
    t.hub.aliases.add(evil.repo)
    return t


def _texts(d: FaultDaemon) -> str:
    """Every log and stderr the daemon wrote under its dir."""
    return "".join(p.read_text(errors="replace") for p in d.base.rglob("*")
                   if p.is_file() and (".log" in p.name or p.suffix == ".stderr"))


def test_a_peer_refusal_logs_no_lan_token_and_the_log_file_is_private(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    """aiohttp's ClientResponseError repr carries the request's headers: logged as ``err=%r``
    on a peer's 503, 500 or 401 it wrote the LAN token into the log (issue 43)."""
    t = pool.hub_thread(small)
    peer = ScriptedPeer(t, [503, 500])
    token = short_tmp("cdlan") / "token"
    token.write_text(LAN_TOKEN + "\n")
    token.chmod(0o600)
    d = pool.daemon(t.hub, [small], args=["--peer", peer.url, "--peer-token-file", str(token),
                                          "--log-file", "LOGFILE"], start=False)
    log_file = d.base / "daemon-file.log"
    d.extra[d.extra.index("LOGFILE")] = str(log_file)
    d.start()
    try:
        with d.client() as c:
            for layer in small.layers[:2]:  # 503 (busy), then 500 (down): the hub serves both
                fetch_verified(c, small, layer, [0])
    finally:
        peer.stop()
    assert peer.answered == [503, 500]
    text = _texts(d)
    assert "peer busy" in text and "peer unavailable" in text, text[-2000:]
    assert LAN_TOKEN not in text and not SECRET_RE.search(text)
    assert stat.S_IMODE(log_file.stat().st_mode) == 0o600
    FIGURES.set("s16.lan_token_in_logs", text.count(LAN_TOKEN))


def test_an_answer_aiohttp_cannot_parse_leaks_no_hub_token(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    """A /resolve with a header over 8,190 bytes: the error the client gets named the request's
    headers, the Hub token among them (``Internal(f"... {exc!r}")``)."""
    t = pool.hub_thread(small, HostileHub)
    t.hub.resolve_header = 9000
    d = pool.daemon(t.hub, [small])
    with d.client() as c, pytest.raises(CachecdError) as info:
        fetch_verified(c, small, small.layers[0], [1])
    # The layout check resolves the shards first (to learn whether they are in Xet), so the
    # answer reaches the client through its refusal (manifest_unchecked), naming the fault.
    assert info.value.code in ("upstream_error", "manifest_unchecked"), info.value.message
    assert "cannot be read" in info.value.message
    assert FAKE_TOKEN not in _texts(d) + info.value.message


@functools.cache
def _bomb() -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip
    zeros = b"\0" * (1 << 20)
    return b"".join(c.compress(zeros) for _ in range(64)) + c.flush()  # 64 MiB inflated


@pytest.fixture(scope="module")
def evils(fault_root: Path) -> dict[str, Model]:
    """A repo per bad answer, each with the small model's very bytes."""
    return {kind: build_model(fault_root, f"faults/evil-{kind}")
            for kind in ("not-json", "deep-json", "gzip-bomb")}


def test_a_bad_metadata_answer_refuses_that_model_only(small: Model, evils: dict[str, Model],  # type: ignore[no-untyped-def]
                                                       pool) -> None:
    """Non-JSON, 200,000-deep JSON and a gzip bomb from /api/models, each about one model: each
    of those is refused in one line naming it; the daemon lives and serves the other."""
    t = pool.hub_thread(small, HostileHub)
    t.hub.aliases.update(m.repo for m in evils.values())
    t.hub.api = {evils["not-json"].repo: b"<html>hello</html>",
                 evils["deep-json"].repo: b"[" * 200_000 + b"]" * 200_000,
                 evils["gzip-bomb"].repo: _bomb()}
    t.hub.api_gzip_for = {evils["gzip-bomb"].repo}
    d = pool.daemon(t.hub, [small, *evils.values()])
    status = d.status()
    assert [m["repo"] for m in status["models"]] == [small.repo]
    refusals = [ln for ln in _texts(d).splitlines() if "model refused" in ln]
    for model in evils.values():
        (why,) = [w for p, w in status["refused_models"].items() if model.repo in w]
        assert "try again later, or another endpoint" in why, why
        assert len([ln for ln in refusals if model.repo in ln]) == 1, refusals
    assert "once decompressed" in status["refused_models"][str(evils["gzip-bomb"].manifest_path)]
    with d.client() as c:
        fetch_verified(c, small, small.layers[0], [2])
        with pytest.raises(CachecdError) as info:
            c.experts(evils["deep-json"].repo, small.layers[0], [2])
    assert info.value.code == "repo_not_allowed"
    FIGURES.set("s16.hostile_answers_refused", len(refusals))


def test_a_gzip_bomb_stops_at_the_cap(small: Model, evil: Model, pool) -> None:  # type: ignore[no-untyped-def]
    """The metadata read inflates at most its cap (16 MiB), not the bomb's 64 MiB: Python's
    allocations while refusing it stay under 40 MiB."""
    from cachecd.manifest.hub_check import metadata_problems

    t = _hostile(pool, small, evil)
    t.hub.api[evil.repo], t.hub.api_gzip_for = _bomb(), {evil.repo}
    tracemalloc.start()
    try:
        with pytest.raises(CachecdError) as info:
            metadata_problems(evil.manifest, endpoint=t.hub.url)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.code == "upstream_answer_invalid"
    assert "over the 16777216-byte limit once decompressed" in info.value.message
    assert peak < 40 << 20, peak
    FIGURES.set("s16.gzip_bomb_peak_mib", round(peak / (1 << 20), 1))


def test_status_answers_while_a_start_check_stalls(small: Model, evil: Model, pool) -> None:  # type: ignore[no-untyped-def]
    """The metadata of a --manifest model stalls mid-body: ``cachecd status`` answers meanwhile
    (the socket was bound after the checks: it did not answer for the stall's length)."""
    t = _hostile(pool, small, evil)
    t.hub.api[evil.repo], t.hub.api_stall_after = b'{"id": "faults/evil", "sha": ', 10
    d = pool.daemon(t.hub, [small, evil], start=False)
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen(d.argv, stdout=log, stderr=log, env=d.env)
    answered = None
    deadline = time.monotonic() + 60
    while answered is None and time.monotonic() < deadline and d.proc.poll() is None:
        if t.hub.api_stalled and t.hub.api_open:  # the check waits on the stalled body now
            proc = run_cli("status", "--socket", str(d.socket), check=False, timeout=30)
            answered = proc if proc.returncode == 0 and t.hub.api_open else None
    t.hub.release()
    assert answered is not None, f"no status while the check stalled:\n{d.log()[-2000:]}"
    assert "starting" in answered.stdout or evil.repo not in answered.stdout
    deadline = time.monotonic() + 60
    while not d._healthy() and time.monotonic() < deadline:
        time.sleep(0.05)  # waits on the daemon's state: healthy once its start checks ended
    d.baseline = d.settle_counts(None)
    assert [m["repo"] for m in d.status()["models"]] == [small.repo]  # its answer was not JSON


def test_manifest_verify_and_setup_say_one_line_for_a_bad_answer(small: Model, evil: Model,  # type: ignore[no-untyped-def]
                                                                  pool) -> None:
    t = _hostile(pool, small, evil)
    t.hub.api[evil.repo] = b"[" * 200_000
    base = short_tmp("cdvs")
    (base / "none.toml").touch()  # no user config reaches the commands
    env = {"HF_TOKEN": FAKE_TOKEN, "HF_HOME": str(base / "hf"),
           "CACHECD_CONFIG": str(base / "none.toml")}
    verify = run_cli("manifest", "verify", str(evil.manifest_path), "--endpoint", t.hub.url,
                     check=False, timeout=60, env=env)
    setup = run_cli("setup", "--stream", f"{evil.repo}@main", "--endpoint", t.hub.url,
                    "--socket", str(base / "s.sock"), "--cache-dir", str(base / "c"),
                    "--models-dir", str(base / "m"), "--no-start", check=False, timeout=60,
                    env=env)
    for proc in (verify, setup):
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
        assert lines[0].startswith("cachecd: upstream_answer_invalid: ") and evil.repo in lines[0]
        assert FAKE_TOKEN not in proc.stdout + proc.stderr


def test_a_redirect_off_the_web_is_refused_by_name(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    """/resolve redirects to a file:// URL, then to a cloud's metadata service: each refused by
    name, nothing asked of either."""
    t = pool.hub_thread(small, HostileHub)
    d = pool.daemon(t.hub, [small])
    with d.client() as c:
        for expert, where in enumerate(["file:///etc/passwd",
                                        "http://169.254.169.254/latest/meta-data/"]):
            t.hub.resolve_to = where
            with pytest.raises(CachecdError) as info:
                fetch_verified(c, small, small.layers[0], [expert])
            assert info.value.code == "redirect_refused", info.value.message
            assert "169.254.169.254" in info.value.message or "file://" in info.value.message
    assert t.hub.count("cdn_get") == 0
