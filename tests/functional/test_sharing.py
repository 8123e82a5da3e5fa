"""Experts shared over the LAN: daemon A serves its verified experts (``serve --share``), daemon B
asks it first (``serve --peer``), real daemons on 127.0.0.1, the local hub's log counting what
reached it. A peer that lies, is down or stalls costs at most its deadline: the Hub serves."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import (
    TINY_REPO,
    DaemonProcess,
    Installed,
    LoggedHub,
    expert_bytes_from_files,
    free_port,
    plant,
    run_cli,
    short_tmp,
)

TOKEN = "s3cret-token-for-tests-only-0123456789"
plant(TOKEN)  # every daemon's log is searched for it at its cleanup (tests/harness.py)


def token_file(text: str = TOKEN, mode: int = 0o600) -> Path:
    path = short_tmp("cdtok") / "token"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def range_requests(hub: LoggedHub, since: int) -> list[tuple[str, str, int]]:
    """Requests for file bytes that reached the hub (GETs of a file, its CDN redirect, or a
    signed xorb range of its Xet store)."""
    return [r for r in hub.requests(since) if r[0] == "GET" and (
        "/resolve/" in r[1] or r[1].startswith(("/_cdn/", "/_xorb/")))]


def ask(url: str, token: str | None = TOKEN, data: bytes | None = None) -> tuple[int, Any, bytes]:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


@pytest.fixture(scope="module")
def logged_hub(hub_root: Path) -> Iterator[LoggedHub]:
    hub = LoggedHub(hub_root)
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def sharer(logged_hub: LoggedHub, tiny_manifest_path: Path, tiny_manifest: Any) -> Iterator[Any]:
    """Daemon A with --share, every expert of the tiny model fetched (warm)."""
    port = free_port()
    a = DaemonProcess(logged_hub.url, [tiny_manifest_path],
                      args=["--share", f"127.0.0.1:{port}",
                            "--share-token-file", str(token_file())]).start()
    a.share_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    with a.client() as c:
        for layer in tiny_manifest.moe_layers:
            c.experts(TINY_REPO, layer, list(range(tiny_manifest.experts_per_layer)))
    yield a
    a.cleanup()


def peer_daemon(hub: LoggedHub, manifest: Path, *peers: str, deadline: float = 2.0,
                min_rate: str | None = None) -> DaemonProcess:
    args = ["--peer-token-file", str(token_file()), "--peer-deadline", str(deadline)]
    args += ["--peer-min-rate", min_rate] if min_rate else []
    for p in peers:
        args += ["--peer", p]
    return DaemonProcess(hub.url, [manifest], args=args).start()


def test_b_runs_the_prompt_from_its_peer_with_zero_hub_ranges_and_bitwise_logits(
        sharer, logged_hub, tiny_manifest_path, tiny_dir):
    from mlx_lm.utils import load_model

    from cachecd_engine.run import load
    from tests.exactness import assert_bitwise, run_logits
    from tests.functional.test_engine_daemon import PROMPT

    base = short_tmp("cdb")
    sock = base / "run" / "s.sock"
    # setup --stream passes the peers the environment (or config file) names on to its daemon.
    env = {"CACHECD_PEERS": sharer.share_url, "CACHECD_PEER_TOKEN_FILE": str(token_file())}
    out = run_cli("setup", "--stream", TINY_REPO, "--endpoint", logged_hub.url, "--socket",
                  str(sock), "--cache-dir", str(base / "cache"), "--models-dir",
                  str(base / "models"), "--manifest", str(tiny_manifest_path), env=env).stdout
    assert "started a daemon" in out
    try:
        mark = logged_hub.mark()
        reference, _ = load_model(tiny_dir)
        model, tokenizer = load(TINY_REPO, sock, ram_bytes=0)
        prompt = tokenizer.encode(PROMPT)
        ref, toks = run_logits(reference, prompt)
        got, _ = run_logits(model, prompt, toks)
        model.bank.source.close()
        assert_bitwise(ref, got)
        # Every expert came from the peer, proven against the content store's proof for its
        # range: the hub served proofs and the windows' widening, no expert read through it.
        assert not [r for r in range_requests(logged_hub, mark) if "/resolve/" in r[1]]
        from cachecd_client import Client

        with Client(sock) as c:
            up = c.stats()["upstream"]
            peers = c.stats()["peers"]
        assert [p["url"] for p in peers] == [sharer.share_url]  # setup passed them on
        assert up["peer_experts"] > 0 and up.get("xet_windows", 0) <= up["xet_proven_headers"]
        assert up["xet_proven_elsewhere"] > 0 and up.get("peer_unproven", 0) == 0
        status = run_cli("status", "--socket", str(sock)).stdout
        assert f"peer        {sharer.share_url} asked before the Hub" in status
    finally:
        Installed(base).cleanup()
    _, _, metrics = ask(f"{sharer.share_url}/metrics")
    served = [ln for ln in metrics.decode().splitlines()
              if ln.startswith("cachecd_share_served_experts_total ")]
    assert served and float(served[0].split()[1]) > 0


def test_peers_are_asked_before_the_hub(sharer, logged_hub, tiny_manifest_path, tiny_manifest,
                                        tiny_dir):
    b = peer_daemon(logged_hub, tiny_manifest_path, sharer.share_url)
    try:
        layer = tiny_manifest.moe_layers[-1]
        with b.client() as c:
            views = c.experts(TINY_REPO, layer, [0, 1, 2, 3])
            for e, view in enumerate(views):
                assert view.tobytes() == expert_bytes_from_files(tiny_dir,
                                                                 tiny_manifest.expert(layer, e))
            up = c.stats()["upstream"]
        # The peer's bytes proven: the proofs and their windows' widening from the hub.
        assert up["xet_proven_elsewhere"] == 4 and up.get("peer_unproven", 0) == 0
        assert up["peer_experts"] == 4 and up["peer_requests"] == 1  # coalesced: one request
    finally:
        b.cleanup()


class FlipProxy:
    """A TCP proxy to ``target`` on its own thread that flips the first byte of each response
    body (the byte after the first blank line): the peer that lies. ``trickle=(n, s)``: it
    passes the answer on unchanged, ``n`` bytes every ``s`` seconds (the slow peer)."""

    def __init__(self, target_port: int, stall: bool = False,
                 trickle: tuple[int, float] | None = None) -> None:
        self.target_port, self.stall, self.trickle = target_port, stall, trickle
        self.loop = asyncio.new_event_loop()
        self.connections = 0
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.stall:  # accept, read, never answer
            await asyncio.sleep(3600)
            return
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       answer: bool) -> None:
            seen, flipped = b"", not answer or self.trickle is not None
            step, pause = self.trickle or (65536, 0.0)
            sent = False
            while data := await src.read(65536):
                if not flipped:
                    at = (seen + data).find(b"\r\n\r\n")
                    if at >= 0 and at + 4 - len(seen) < len(data):
                        i = at + 4 - len(seen)
                        data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
                        flipped = True
                    seen = (seen + data)[-4:]
                for at in range(0, len(data), step if answer else len(data)):
                    if sent and answer and pause:
                        await asyncio.sleep(pause)
                    dst.write(data[at:at + step] if answer else data)
                    await dst.drain()
                    sent = True
            dst.close()

        await asyncio.gather(pipe(reader, up_w, False), pipe(up_r, writer, True),
                             return_exceptions=True)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_a_peer_that_flips_bytes_is_skipped_and_the_hub_serves(sharer, logged_hub,
                                                               tiny_manifest_path, tiny_manifest,
                                                               tiny_dir):
    port = int(sharer.share_url.rsplit(":", 1)[1])
    proxy = FlipProxy(port)
    b = peer_daemon(logged_hub, tiny_manifest_path, proxy.url)
    try:
        mark = logged_hub.mark()
        layer = tiny_manifest.moe_layers[0]
        with b.client() as c:
            for e, view in enumerate(c.experts(TINY_REPO, layer, [0, 1])):
                assert view.tobytes() == expert_bytes_from_files(tiny_dir,
                                                                 tiny_manifest.expert(layer, e))
            stats = c.stats()
            c.experts(TINY_REPO, layer, [2])  # skipped now: not asked again
            after = c.stats()["upstream"]
        assert not list((b.cache_dir / "tmp").iterdir())  # the wrong bytes' temp is gone
        assert range_requests(logged_hub, mark)  # the hub served instead
        assert stats["upstream"]["peer_lies"] == 1 and stats["upstream"]["peer_skipped"] == 1
        assert after["peer_requests"] == stats["upstream"]["peer_requests"]
        assert stats["peers"][0]["skipped_for_s"] > 60
        status = run_cli("status", "--socket", str(b.socket)).stdout
        assert "SKIPPED" in status and "1 times wrong bytes" in status
    finally:
        b.cleanup()
        proxy.stop()


@pytest.mark.parametrize("how", ["down", "stalls"])
def test_a_peer_down_or_stalling_costs_at_most_its_deadline(how, logged_hub, tiny_manifest_path,
                                                            tiny_manifest, tiny_dir):
    proxy = FlipProxy(1, stall=True) if how == "stalls" else None
    url = proxy.url if proxy else f"http://127.0.0.1:{free_port()}"
    b = peer_daemon(logged_hub, tiny_manifest_path, url, deadline=0.5)
    try:
        layer = tiny_manifest.moe_layers[1]
        with b.client() as c:
            t0 = time.monotonic()
            view = c.expert(TINY_REPO, layer, 5)
            took = time.monotonic() - t0
            up = c.stats()["upstream"]
        assert view.tobytes() == expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, 5))
        assert took < 0.5 + 5.0
        assert up[f"peer_faults_{'timeout' if how == 'stalls' else 'connect'}"] == 1
        assert up.get("requests_range", 0) + up.get("requests_xet_xorb", 0) >= 1
        # status says so: down and skipped for a while, not "asked before the Hub"
        status = run_cli("status", "--socket", str(b.socket)).stdout
        why = "no answer within its deadline" if how == "stalls" else "could not connect"
        assert f"peer        {url} SKIPPED for " in status and f"down: {why}" in status, status
    finally:
        b.cleanup()
        if proxy:
            proxy.stop()


def test_a_slow_but_steady_peer_is_used_past_its_deadline(sharer, logged_hub, tiny_manifest_path,
                                                          tiny_manifest, tiny_dir):
    """The deadline bounds connecting, the first byte and any stall, not the whole transfer: an
    answer trickling in over several deadlines, never pausing for one, comes from the peer (at
    a rate above --peer-min-rate, set low here for the tiny model's few kilobytes)."""
    layer, ids = tiny_manifest.moe_layers[3], [0, 1, 2, 3]
    body = sum(tiny_manifest.expert(layer, e).nbytes for e in ids)
    pause, deadline = 0.3, 1.0
    proxy = FlipProxy(int(sharer.share_url.rsplit(":", 1)[1]), trickle=(body // 8 + 1, pause))
    b = peer_daemon(logged_hub, tiny_manifest_path, proxy.url, deadline=deadline, min_rate="1KiB")
    try:
        mark = logged_hub.mark()
        with b.client() as c:
            t0 = time.monotonic()
            views = c.experts(TINY_REPO, layer, ids)
            took = time.monotonic() - t0
            up = c.stats()["upstream"]
        for e, view in zip(ids, views, strict=True):
            assert view.tobytes() == expert_bytes_from_files(tiny_dir, tiny_manifest.expert(layer, e))
        # Every expert came from the peer, proven against the content store's proof for its
        # range: the hub served proofs and the windows' widening, no expert read through it.
        assert not [r for r in range_requests(logged_hub, mark) if "/resolve/" in r[1]]
        assert up["peer_experts"] == len(ids)
        assert not [k for k in up if k.startswith("peer_faults_")]
        assert took > 2 * deadline  # although the answer outlasted the deadline
    finally:
        b.cleanup()
        proxy.stop()


def test_share_refuses_without_the_token_and_serves_only_blobs_by_digest(sharer, tiny_manifest,
                                                                         tiny_dir):
    entry = tiny_manifest.expert(tiny_manifest.moe_layers[0], 3)
    digest = entry.xxh3.hex()
    url = f"{sharer.share_url}/v2/blob/{digest}/{entry.source}"
    assert ask(url, token=None)[0] == 401
    assert ask(url, token="wrong")[0] == 401
    assert ask(url, token=TOKEN + "x")[0] == 401
    assert ask(f"{sharer.share_url}/metrics", token=None)[0] == 401
    status, headers, body = ask(url)
    assert status == 200 and body == expert_bytes_from_files(tiny_dir, entry)
    for bad in ("..%2F..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", digest.upper(), digest[:-1],
                "0" * 32):
        assert ask(f"{sharer.share_url}/v2/blob/{bad}/{entry.source}")[0] == 404, bad
    # Coalesced: the blobs it has, in order, their sizes in a header (0: not here).
    other = tiny_manifest.expert(tiny_manifest.moe_layers[0], 4)

    def item(d: str, s: str) -> dict[str, str]:
        return {"digest": d, "source": s}

    asked = json.dumps([item(digest, entry.source), item("0" * 32, entry.source),
                        item("../../etc/passwd", entry.source),
                        item(other.xxh3.hex(), other.source)]).encode()
    status, headers, body = ask(f"{sharer.share_url}/v2/blobs", data=asked)
    assert status == 200
    assert headers["X-Cachecd-Sizes"] == f"{entry.nbytes},0,0,{other.nbytes}"
    assert body == (expert_bytes_from_files(tiny_dir, entry)
                    + expert_bytes_from_files(tiny_dir, other))
    assert ask(f"{sharer.share_url}/v2/blobs", data=b"{not json")[0] == 400
    assert ask(f"{sharer.share_url}/v2/blobs", data=json.dumps([digest]).encode())[0] == 400
    # By digest alone (protocol 1): gone, with what to do
    status, _, body = ask(f"{sharer.share_url}/v1/blob/{digest}")
    assert status == 410 and b"upgrade cachecd" in body
    _, _, metrics = ask(f"{sharer.share_url}/metrics")
    text = metrics.decode()
    assert 'cachecd_share_refused_total{reason="unauthorized"} 4.0' in text
    assert 'cachecd_share_refused_total{reason="bad_digest"}' in text


def _expect_first_line(url: str, token: str) -> bytes:
    """The first line a share answers a POST that waits for ``100 Continue`` before its body."""
    import socket as sk

    host, port = url.removeprefix("http://").rsplit(":", 1)
    with sk.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(f"POST /v2/blobs HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}"
                     "\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n".encode())
        return conn.makefile("rb").readline().strip()


def test_the_share_checks_the_token_before_it_answers_100_continue(sharer):
    assert _expect_first_line(sharer.share_url, "not-the-token") == b"HTTP/1.1 401 Unauthorized"
    assert _expect_first_line(sharer.share_url, TOKEN) == b"HTTP/1.1 100 Continue"


def test_a_token_holders_nested_json_is_a_400_not_a_500(sharer):
    status, _, body = ask(f"{sharer.share_url}/v2/blobs", data=b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and b"expected a JSON list" in body, (status, body[:200])
    assert "Traceback" not in sharer.log(), sharer.log()[-3000:]


@pytest.mark.parametrize(("text", "mode", "says"), [
    (None, 0o600, "cannot read"),
    ("", 0o600, "is empty"),
    (TOKEN, 0o644, "readable by every user"),
    (TOKEN, 0o620, "writable by its group (mode 620); make it private: `chmod 600"),
    (TOKEN, 0o602, "writable by every user"),
])
def test_a_bad_token_file_stops_serve_with_what_to_do(text, mode, says):
    path = token_file(text or "", mode)
    if text is None:
        path.unlink()
    base = short_tmp("cdtf")
    for flags in (["--share", f"127.0.0.1:{free_port()}", "--share-token-file", str(path)],
                  ["--peer", "http://127.0.0.1:1", "--peer-token-file", str(path)]):
        proc = run_cli("serve", "--cache-dir", str(base / "c"), "--socket",
                       str(base / "s.sock"), *flags, check=False, timeout=60)
        assert proc.returncode != 0 and says in proc.stderr, proc.stderr
        assert "token" in proc.stderr and not (base / "c").exists()


def test_service_render_carries_peers_and_sharing():
    tok = token_file()
    out = run_cli("service", "render", "--platform", "systemd", "--share", "127.0.0.1:7390",
                  "--share-token-file", str(tok), "--peer", "http://10.0.0.2:7390",
                  "--peer-token-file", str(tok), "--peer-deadline", "1.5").stdout
    for flag in ("--share 127.0.0.1:7390", f"--share-token-file {tok}",
                 "--peer http://10.0.0.2:7390", f"--peer-token-file {tok}", "--peer-deadline 1.5"):
        assert flag in out


def test_a_blob_from_before_a_restart_is_hashed_before_it_is_shared(logged_hub, tiny_manifest_path,
                                                                   tiny_manifest, tiny_dir):
    port = free_port()
    d = DaemonProcess(logged_hub.url, [tiny_manifest_path],
                      args=["--share", f"127.0.0.1:{port}", "--share-token-file",
                            str(token_file()), "--scrub-rate", "0"]).start()  # the share's own hash
    try:
        layer = tiny_manifest.moe_layers[2]
        good, bad = tiny_manifest.expert(layer, 0), tiny_manifest.expert(layer, 1)
        with d.client() as c:
            c.experts(TINY_REPO, layer, [0, 1])
        d.stop()
        rotten = d.cache_dir / "blobs" / bad.digest_hex[:2] / bad.digest_hex
        data = bytearray(rotten.read_bytes())
        data[len(data) // 2] ^= 0x01  # same size: only the hash tells
        rotten.write_bytes(bytes(data))
        d.start()
        share = f"http://127.0.0.1:{port}/v2/blob/"
        status, _, body = ask(f"{share}{good.digest_hex}/{good.source}")
        assert status == 200 and body == expert_bytes_from_files(tiny_dir, good)
        assert ask(f"{share}{bad.digest_hex}/{bad.source}")[0] == 404  # rot: never sent
        with d.client() as c:
            store = c.stats()["store"]
        assert store["verified_on_open"] == 1 and store["bit_rot_on_open"] == 1
    finally:
        d.cleanup()


def test_a_peer_asked_for_an_aliased_digest_serves_nothing_for_it(sharer, logged_hub,
                                                                 tiny_manifest_path, tiny_manifest,
                                                                 tiny_dir, tmp_path):
    """B's manifest gives expert (L, 0) the digest of (L, 1), which A has cached (verified as
    (L, 1)'s bytes): A serves it only as (L, 1), so B's (L, 0) is checked against its own ranges
    at the Hub (read through Xet and proven there, so the manifest is named as what is wrong),
    and refused naming the manifest."""
    from cachecd.errors import ManifestMismatch
    from tests import tampered

    layer = tiny_manifest.moe_layers[1]
    alias, owner = tiny_manifest.expert(layer, 0), tiny_manifest.expert(layer, 1)
    bad = tampered.alias_digests(tiny_manifest_path, tmp_path / "alias.manifest",
                                 {tiny_manifest.row(layer, 0): tiny_manifest.row(layer, 1)})
    b = peer_daemon(logged_hub, bad, sharer.share_url)
    try:
        with b.client() as c:
            with pytest.raises(ManifestMismatch) as info:
                c.expert(TINY_REPO, layer, 0)
            assert str(bad) in info.value.message
            assert f"layer={layer} expert=0" in info.value.message
            got = c.expert(TINY_REPO, layer, 1).tobytes()  # the owner flows from the peer
            assert got == expert_bytes_from_files(tiny_dir, owner)
            assert c.stats()["upstream"]["peer_experts"] == 1
    finally:
        b.cleanup()
    asked = json.dumps([{"digest": owner.digest_hex, "source": alias.source}]).encode()
    status, headers, _ = ask(f"{sharer.share_url}/v2/blobs", data=asked)
    assert status == 200 and headers["X-Cachecd-Sizes"] == "0"  # not as (L, 0)'s bytes
