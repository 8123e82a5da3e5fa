"""Two `cachecd setup --stream` of one model at once, with no daemon running (two real
subprocesses, the local hub): both end well, one daemon serves the model, and a setup that found
the other at work said so ("another setup is installing ...") and waited for it. Before, the
second died on the resident file's temp (`enoent`) or on the cache's lock (`cache_locked`) of
the daemon the first started."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.harness import CACHECD, TINY_REPO, HubProcess, run_cli, short_tmp, stop_daemon


def test_two_setups_of_one_model_at_once_both_end_with_one_daemon(
        hub: HubProcess, tiny_manifest_path: Path) -> None:
    base = short_tmp("cdcc")
    socket = base / "run" / "s.sock"
    argv = [*CACHECD, "setup", "--stream", TINY_REPO, "--endpoint", hub.url, "--socket",
            str(socket), "--models-dir", str(base / "models"), "--cache-dir",
            str(base / "cache"), "--manifest", str(tiny_manifest_path)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
             for _ in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, f"exit {p.returncode}\n{out}\n{err}"
        started = [out for out, _ in outs if "started a daemon" in out]
        assert len(started) == 1, outs
        waited = [out for out, _ in outs if f"another setup is installing {TINY_REPO} (pid " in out]
        assert len(waited) <= 1, outs
        assert all("installed" in out for out, _ in outs), outs
        status = run_cli("status", "--socket", str(socket)).stdout
        assert TINY_REPO in status, status
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        try:
            stop_daemon(socket)
        except Exception:
            pass
