"""Ctrl-C during `cachecd setup --stream` says how to go on: run the same command again, which
resumes. The Hub is the local hub behind a proxy that holds every shard read, so setup is
interrupted mid-fetch (a state the test waits for, not a time); the rerun then finishes."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.functional.test_wait_progress import HoldingProxy
from tests.harness import CACHECD, TINY_REPO, Installed, run_cli, short_tmp


def test_ctrl_c_says_rerun_to_resume(hub: Any, tiny_manifest_path: Path) -> None:
    proxy = HoldingProxy(hub.url).start()
    inst = Installed(short_tmp("cdi"))
    args = ["setup", "--stream", TINY_REPO, "--endpoint", proxy.url, "--socket", str(inst.socket),
            "--cache-dir", str(inst.base / "cache"), "--models-dir", str(inst.base / "models"),
            "--manifest", str(tiny_manifest_path)]
    proxy.holding.set()
    try:
        # A suite started in the background runs with SIGINT ignored: give the child Ctrl-C back.
        proc = subprocess.Popen([*CACHECD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        while not proxy.held:  # setup is reading the shards
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proxy.holding.clear()
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err
        assert f"interrupted; run `cachecd {' '.join(args)}` again to resume" in err, err
        assert "Traceback" not in err, err
        assert "installed" in run_cli(*args).stdout  # and it does
    finally:
        proxy.holding.clear()
        inst.cleanup()
        proxy.stop()
