"""`cachecd stop` as a user runs it: the daemon `cachecd setup --stream` started drains and exits;
with none running it says so (exit 3); one still draining after --wait is reported with its pid
(exit 1), sent nothing stronger than SIGTERM, and ends on its own once its fetch does."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

from cachecd.errors import CachecdError
from tests.harness import TINY_REPO, DaemonProcess, HubProcess, Installed, run_cli


def test_stop_ends_the_daemon_setup_started(installed: Installed) -> None:
    sock = str(installed.socket)
    with installed.client() as c:
        pid = c.health()["pid"]
    done = run_cli("stop", "--socket", sock)
    assert f"(pid {pid})" in done.stdout and done.stdout.rstrip().endswith("stopped"), done.stdout
    assert not installed.socket.exists()  # the daemon's last step before it exits
    assert run_cli("status", "--socket", sock, check=False).returncode == 3
    again = run_cli("stop", "--socket", sock, check=False)
    assert again.returncode == 3, again.stderr
    assert again.stderr.strip().splitlines()[-1] == (
        f"cachecd: daemon_unavailable: no daemon answers on {sock}: nothing to stop")


def test_a_daemon_still_draining_after_the_wait_is_reported_not_killed(
        hub_root: Path, tiny_manifest_path: Path, tiny_manifest: Any) -> None:
    live = HubProcess(hub_root)  # the daemon checks its manifest against it at start
    d = DaemonProcess(live.url, [tiny_manifest_path],
                      env={"CACHECD_SHUTDOWN_TIMEOUT": "120", "CACHECD_READ_TIMEOUT": "120",
                           "CACHECD_TOTAL_TIMEOUT": "240"}).start()
    live.stop()
    hub = socket.socket()  # then, on its port, the kernel accepts and nobody ever answers
    hub.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hub.bind(("127.0.0.1", int(live.url.rsplit(":", 1)[1])))
    hub.listen(64)
    fetch = threading.Thread(target=_fetch, args=(d, tiny_manifest.moe_layers[0]), daemon=True)
    try:
        fetch.start()
        with d.client() as c:
            _wait_for(lambda: c.stats()["inflight"] >= 1)
            pid = c.health()["pid"]
        late = run_cli("stop", "--socket", str(d.socket), "--wait", "1", check=False)
        assert late.returncode == 1, late.stderr
        line = late.stderr.strip().splitlines()[-1]
        assert line.startswith("cachecd: stop_timeout: ") and f"(pid {pid})" in line, line
        assert d.proc is not None and d.proc.poll() is None  # SIGTERM only: still draining
        hub.close()  # the fetch fails at once, the drain ends, the daemon exits as asked
        assert d.proc.wait(60) == 0, d.log()
    finally:
        hub.close()
        d.cleanup()


def _fetch(d: DaemonProcess, layer: int) -> None:
    try:
        with d.client() as c:
            c.expert(TINY_REPO, layer, 0)
    except CachecdError:
        pass  # the upstream went away: what the test does on purpose


def _wait_for(state: Any) -> None:
    import time

    deadline = time.monotonic() + 60  # a bound on a hang: the state ends the wait
    while not state():
        assert time.monotonic() < deadline, "state not reached"
        time.sleep(0.05)
