"""The share's door (``serve --share``) held by strangers: a real daemon whose fd limit is 256
(launchd's default; set for it before exec, soft and hard, so it cannot raise it), idle TCP
connections without a token well past that, stalled bodies of authorized POSTs. Local clients'
reads and authorized peers are still served, the log stays small, and every stranger's
connection is closed by the door or a deadline. Also: what a token holder's ``/metrics`` shows,
the token file's checks and a share on a wildcard address, through the command line."""

from __future__ import annotations

import errno
import os
import resource
import select
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.functional.test_sharing import (
    TOKEN,
    ask,
    logged_hub,
    peer_daemon,
    sharer,
    token_file,
)
from tests.harness import (
    TINY_REPO,
    DaemonProcess,
    LoggedHub,
    expert_bytes_from_files,
    free_port,
    run_cli,
    short_tmp,
)

__all__ = ["logged_hub", "sharer"]  # fixtures, used by name

FD_LIMIT = 256
STRANGERS = 400  # idle connections: well past the daemon's whole fd limit


def _low_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def _wait(pred: Callable[[], bool], seconds: float) -> bool:
    """Poll ``pred`` until true or ``seconds`` pass (the bound, not the measure: callers assert
    on state afterwards)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if pred():
                return True
        except Exception:  # a daemon that cannot answer now: the assertions after say so
            pass
        time.sleep(0.1)
    return False


def _share_status(d: DaemonProcess) -> dict[str, Any]:
    with d.client(timeout=5) as c:
        return dict(c.stats()["share"])


def _connect_silently(port: int, n: int) -> list[socket.socket]:
    """``n`` TCP connections to the share that never send a byte (non-blocking connects: the
    kernel finishes them as the daemon accepts)."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        err = s.connect_ex(("127.0.0.1", port))
        assert err in (0, errno.EINPROGRESS), os.strerror(err)
        out.append(s)
    return out


def _closed_by_the_daemon(socks: list[socket.socket], seconds: float) -> int:
    """How many of ``socks`` the daemon closed (EOF or reset) within ``seconds``."""
    pending, closed = set(socks), 0
    end = time.monotonic() + seconds
    while pending and time.monotonic() < end:
        ready, _, _ = select.select(list(pending)[:500], [], [], 0.5)
        for s in ready:
            pending.discard(s)
            try:
                closed += s.recv(1) == b""
            except OSError:  # reset, or a connect the daemon refused
                closed += 1
    for s in socks:
        s.close()
    return closed


@pytest.fixture(scope="module")
def low_sharer(logged_hub: LoggedHub, tiny_manifest_path: Path, tiny_manifest: Any
               ) -> Iterator[DaemonProcess]:
    port = free_port()
    d = DaemonProcess(logged_hub.url, [tiny_manifest_path], preexec_fn=_low_fds,
                      args=["--share", f"127.0.0.1:{port}", "--share-token-file",
                            str(token_file()),
                            "--scrub-rate", "0"]).start()  # its pass lines are not the door's
    d.share_port = port  # type: ignore[attr-defined]
    d.share_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    with d.client() as c:
        c.experts(TINY_REPO, tiny_manifest.moe_layers[0], [0, 1, 2, 3])
    yield d
    d.cleanup()


def test_idle_strangers_past_the_fd_limit_leave_local_reads_and_peers_served(
        low_sharer, logged_hub, tiny_manifest_path, tiny_manifest, tiny_dir):
    d = low_sharer
    strangers = _connect_silently(d.share_port, STRANGERS)
    try:
        # The door has seen most of them (dropped or refused) before the clients below ask.
        _wait(lambda: sum(v for k, v in _share_status(d).items()
                          if k in ("connections_dropped", "connections_refused"))
              >= STRANGERS // 2, 30)
        with d.client(timeout=30) as c:  # misses: fetched from the hub, fds for each
            for layer in tiny_manifest.moe_layers[1:3]:
                ids = list(range(tiny_manifest.experts_per_layer))
                for e, view in zip(ids, c.experts(TINY_REPO, layer, ids), strict=True):
                    assert view.tobytes() == expert_bytes_from_files(
                        tiny_dir, tiny_manifest.expert(layer, e))
        b = peer_daemon(logged_hub, tiny_manifest_path, d.share_url)
        try:
            layer = tiny_manifest.moe_layers[0]
            with b.client() as c:
                views = c.experts(TINY_REPO, layer, [0, 1, 2, 3])
                up = c.stats()["upstream"]
            for e, view in enumerate(views):
                assert view.tobytes() == expert_bytes_from_files(tiny_dir,
                                                                 tiny_manifest.expert(layer, e))
            assert up["peer_experts"] == 4  # the authorized peer got in past the strangers
        finally:
            b.cleanup()
        # The silent ones the door kept are closed when their head does not come in time.
        _wait(lambda: _share_status(d).get("connections_header_timed_out", 0) > 0, 30)
        assert _share_status(d).get("connections_header_timed_out", 0) > 0
    finally:
        for s in strangers:
            s.close()
    _wait(lambda: _share_status(d)["connections"] == 0, 30)
    share = _share_status(d)
    assert share["connections"] == 0
    assert share["connection_limit"] <= FD_LIMIT // 4
    status = run_cli("status", "--socket", str(d.socket)).stdout
    assert f"connections 0 of {share['connection_limit']}" in status and "closed by the door" in status
    assert d.log_path.stat().st_size < 64 << 10, d.log()[-4000:]  # counted, not a line each
    assert "Too many open files" not in d.log()


def test_stalled_authorized_bodies_do_not_hold_the_request_bound(sharer, tiny_manifest,
                                                                  tiny_dir):
    """More stalled POST bodies than the share answers requests at once (16): a GET still gets
    its blob, and the stalled ones are closed by the body's deadline. (A daemon with the usual
    fd limit: under 256 fds one address may hold only 16 connections, so the GET would wait for
    the deadline.)"""
    d = sharer
    d.share_port = int(d.share_url.rsplit(":", 1)[1])
    head = (f"POST /v2/blobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n[").encode()
    stalled = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", d.share_port), timeout=10)
        s.sendall(head)
        stalled.append(s)
    before = _share_status(d).get("connections_body_timed_out", 0)
    try:
        entry = tiny_manifest.expert(tiny_manifest.moe_layers[0], 2)
        status, _, body = ask(f"{d.share_url}/v2/blob/{entry.xxh3.hex()}/{entry.source}")
        assert status == 200 and body == expert_bytes_from_files(tiny_dir, entry)
        assert _closed_by_the_daemon(stalled, 60) == len(stalled)
    finally:
        for s in stalled:
            s.close()
    assert _share_status(d)["connections_body_timed_out"] - before == len(stalled)


def test_metrics_show_a_token_holder_no_cache_path_and_no_model(low_sharer):
    status, _, body = ask(f"{low_sharer.share_url}/metrics")
    text = body.decode()
    assert status == 200
    assert "cachecd_share_served_experts_total" in text  # what docs/sharing.md lists
    assert str(low_sharer.cache_dir) not in text and "cache_dir" not in text
    assert TINY_REPO not in text and "model" not in text
    names = {ln.split("{")[0].split()[0] for ln in text.splitlines() if ln and ln[0] != "#"}
    assert all(n.startswith(("cachecd_share_", "cachecd_upstream_peer_")) for n in names), names


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a file to another uid needs root")
@pytest.mark.parametrize(("what", "says"), [
    ("group", "readable by its group"),
    ("owner", "owned by uid 65534"),
    ("short", "bits of secret"),
])
def test_a_weak_token_file_stops_serve_with_what_to_do(what, says):
    path = token_file("0123456789abcdef" if what == "short" else TOKEN,
                      0o640 if what == "group" else 0o600)
    if what == "owner":
        os.chown(path, 65534, 65534)
    base = short_tmp("cdtw")
    for flags in (["--share", f"127.0.0.1:{free_port()}", "--share-token-file", str(path)],
                  ["--peer", "http://127.0.0.1:1", "--peer-token-file", str(path)]):
        proc = run_cli("serve", "--cache-dir", str(base / "c"), "--socket", str(base / "s.sock"),
                       *flags, check=False, timeout=30)
        assert proc.returncode != 0 and says in proc.stderr, proc.stderr
        assert not (base / "c").exists()


@pytest.mark.parametrize(("host", "says"), [
    ("0.0.0.0", "listens on every interface"),
    ("[::]", "listens on every interface"),
    ("8.8.8.8", "is a public address"),
])
def test_share_on_a_wildcard_or_public_address_says_so_on_start(host, says):
    """The warning comes before anything is bound; a missing token file then stops serve, so
    nothing here listens beyond 127.0.0.1."""
    base = short_tmp("cdtx")
    proc = run_cli("serve", "--cache-dir", str(base / "c"), "--socket", str(base / "s.sock"),
                   "--share", f"{host}:{free_port()}", "--share-token-file",
                   str(base / "missing"), check=False, timeout=30)
    assert proc.returncode != 0 and "cannot read" in proc.stderr
    assert says in proc.stderr, proc.stderr


def test_a_wrong_token_gets_its_401_and_the_connection_closed(sharer):
    port = int(sharer.share_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer guess\r\n\r\n")
        got = b""
        for _ in range(100):  # bounded: the answer is a few hundred bytes, then EOF
            chunk = s.recv(65536)  # a kept-alive connection would time out here instead
            if not chunk:
                break
            got += chunk
    assert got.startswith(b"HTTP/1.1 401") and b"Connection: close" in got, got[:200]


def test_malformed_requests_are_counted_not_logged_each(low_sharer):
    d = low_sharer
    junk = b"GET /metrics HTTP/1.1\r\nHost: x\r\nnot a header line\r\n\r\n"
    before = d.log_path.stat().st_size
    for _ in range(400):  # one connection each, as a scanner sends them
        with socket.create_connection(("127.0.0.1", d.share_port), timeout=10) as s:
            s.sendall(junk)
            assert s.recv(65536).split(b" ")[1] == b"400"
    assert d.log_path.stat().st_size - before < 4096, d.log()[-2000:]
    assert _share_status(d)["connections_malformed"] >= 400
