"""Setups at once with no daemon running (real subprocesses, the local hub): two of one model and
one of another. All three end well with one daemon serving both models; the second setup of a
model waits for the first, saying "another setup is installing ORG/NAME (pid N)", then finds the
install done, and a setup that finds another starting the daemon waits for it and registers
with that daemon. Before, a second setup of a model died on the resident file's temp (`enoent`)
and each setup started a daemon, all but one of them dying on the cache's lock."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from tests.harness import CACHECD, HubProcess, run_cli, short_tmp, stop_daemon

ONE, OTHER = "cachecd/tiny-a", "cachecd/tiny-b"


@pytest.fixture(scope="module")
def two_models() -> Iterator[HubProcess]:
    from cachecd.testbed.tiny_model import write_tiny_model

    root = short_tmp("cdtm")
    write_tiny_model(root / ONE, seed=1)
    write_tiny_model(root / OTHER, seed=2)
    hub = HubProcess(root)
    yield hub
    hub.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_setups_at_once_end_with_one_daemon_serving_both_models(two_models: HubProcess) -> None:
    base = short_tmp("cdcc")
    socket = base / "run" / "s.sock"

    def setup(repo: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*CACHECD, "setup", "--stream", repo, "--build-manifest", "--endpoint",
             two_models.url, "--socket", str(socket), "--models-dir", str(base / "models"),
             "--cache-dir", str(base / "cache")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"})

    procs = [setup(ONE), setup(ONE), setup(OTHER)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, f"exit {p.returncode}\n{out}\n{err}"
            assert "installed" in out, out
        assert sum("started a daemon" in out for out, _ in outs) == 1, outs
        waited = [out for out, _ in outs[:2] if f"another setup is installing {ONE} (pid " in out]
        assert len(waited) <= 1, outs
        status = run_cli("status", "--socket", str(socket)).stdout
        assert ONE in status and OTHER in status, status
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        try:
            stop_daemon(socket)
        except Exception:
            pass
        shutil.rmtree(base, ignore_errors=True)

