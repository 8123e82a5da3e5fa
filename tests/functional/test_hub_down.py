"""The Hub down or stalled on the second day, as a user meets it: `cachecd warm` and `cachecd run`
through a daemon (started by `cachecd setup --stream`) whose endpoint stops answering. Each ends
in one typed line within seconds (not minutes of retries, not the HTTP library's exception
text), and while a fetch waits on a stalled Hub the waiting command says so."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import CACHECD, TINY_REPO, Installed, run_cli, short_tmp

TIMEOUTS = {"CACHECD_READ_TIMEOUT": "2", "CACHECD_TOTAL_TIMEOUT": "6"}


class Endpoint:
    """`cachecd hub serve` on a port of its own, which the test can take down (nothing listens:
    connections are refused) or stall (a listener that never answers)."""

    def __init__(self, root: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.root = root
        self.proc: subprocess.Popen[str] | None = None
        self.listener: socket.socket | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([*CACHECD, "hub", "serve", str(self.root), "--port",
                                      str(self.port)], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None and "http://" in self.proc.stdout.readline()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def stall(self) -> None:
        self.stop()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", self.port))
        # The kernel accepts (a backlog that every retry's connection fits in); nobody answers.
        self.listener.listen(4096)


@pytest.fixture(scope="module")
def endpoint(hub_root: Path) -> Iterator[Endpoint]:
    e = Endpoint(hub_root)
    e.start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def inst(endpoint: Endpoint, tiny_manifest_path: Path, tiny_manifest) -> Iterator[Installed]:  # type: ignore[no-untyped-def]
    inst = Installed(short_tmp("cdhd"))
    run_cli("setup", "--stream", TINY_REPO, "--endpoint", endpoint.url, "--socket",
            str(inst.socket), "--cache-dir", str(inst.base / "cache"), "--models-dir",
            str(inst.base / "models"), "--manifest", str(tiny_manifest_path), env=TIMEOUTS)
    with inst.client() as c:  # a workload for warm --top to rank by, then a cold cache
        for layer in tiny_manifest.moe_layers[:2]:
            c.experts(TINY_REPO, layer, list(range(8)))
        c.evict(1 << 40)
    yield inst
    inst.cleanup()


def timed(*argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    proc = run_cli(*argv, check=False, timeout=120)
    return proc, time.monotonic() - t0


def run_after_load(inst: Installed) -> tuple[str, str, float]:
    """`cachecd run`: (stdout, stderr, seconds from the model loaded to the exit)."""
    proc = subprocess.Popen([*CACHECD, "run", "--model", TINY_REPO, "--socket", str(inst.socket),
                             "--prompt", "Hello", "--max-tokens", "4"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None and proc.stdout is not None
    notice = proc.stderr.readline()  # "cache: ... are local" comes once the model is loaded
    t0 = time.monotonic()
    rest = proc.stderr.read()
    proc.wait(120)
    assert notice.startswith("cache: "), notice + rest
    assert proc.returncode == 1, notice + rest
    return proc.stdout.read(), rest, time.monotonic() - t0


def test_a_hub_that_is_down_is_one_line_within_seconds(endpoint: Endpoint, inst: Installed) -> None:
    endpoint.stop()
    try:
        proc, took = timed("warm", "--model", TINY_REPO, "--socket", str(inst.socket), "--top", "16")
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 1 and took < 10, (took, proc.stderr)  # was 108 s
        assert last.startswith(f"cachecd: warm stopped: upstream_error: cannot reach {endpoint.url} "
                               "(Connection refused)"), proc.stderr
        assert "--endpoint" in last and "Client" not in proc.stderr, proc.stderr
        out, err, took = run_after_load(inst)
        assert took < 6, (took, err)  # was 9 s of retries
        line = err.strip().splitlines()[-1]
        assert line.startswith(f"cachecd: upstream_error: cannot reach {endpoint.url}"), err
        assert "Traceback" not in err and "Client" not in err
    finally:
        endpoint.start()


def test_a_stalled_hub_is_waited_for_out_loud(endpoint: Endpoint, inst: Installed) -> None:
    endpoint.stall()
    try:
        proc, took = timed("warm", "--model", TINY_REPO, "--socket", str(inst.socket), "--top", "16")
        assert proc.returncode == 1 and took < 20, (took, proc.stderr)
        assert "still waiting for the daemon" in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(
            "cachecd: warm stopped: upstream_timeout: "), proc.stderr
        _, err, _ = run_after_load(inst)
        assert "still waiting for the daemon" in err and "timeout x" in err, err
        assert err.strip().splitlines()[-1].startswith("cachecd: upstream_timeout: "), err
    finally:
        endpoint.stop()  # the last test of the module: the port stays closed
