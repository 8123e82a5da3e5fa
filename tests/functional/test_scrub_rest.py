"""The background scrub of a real daemon on a small cache: at most one ``scrub_pass_done`` log
line a minute however many passes it makes, and once every blob is scrubbed the thread rests
(the pass counter stops) until a blob comes in."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tests.harness import TINY_REPO, DaemonProcess, run_cli


def _scrub(daemon: DaemonProcess) -> dict[str, Any]:
    with daemon.client() as c:
        return c.stats()["scrub"]


def _until(what: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := what():
            return got
        time.sleep(0.02)
    raise AssertionError(f"not reached in {timeout}s")


def test_a_small_cache_logs_once_a_minute_and_rests_when_scrubbed(hub, tiny_manifest_path,
                                                                   tiny_manifest) -> None:
    # A fast scrub over a tiny cache: each pass takes microseconds, as a small cache's does at
    # the default rate; before, it passed and logged about 30 times a second, idle or not.
    daemon = DaemonProcess(hub.url, [tiny_manifest_path], args=["--scrub-rate", "1GiB"]).start()
    try:
        layer = tiny_manifest.moe_layers[0]
        with daemon.client() as c:
            for expert in range(6):  # each blob that comes in calls for a pass
                before = _scrub(daemon)["passes"]
                c.experts(TINY_REPO, layer, [expert])
                _until(lambda before=before: _scrub(daemon)["passes"] > before)
        lines = [ln for ln in daemon.log().splitlines() if "event=scrub_pass_done" in ln]
        assert len(lines) == 1 and "passes=1 " in lines[0], lines[:5]
        rested = _until(lambda: (s := _scrub(daemon)) and "resting_until" in s and s)
        assert rested["passes"] >= 6

        # Resting: nothing changes, so no pass starts (before, thousands would meanwhile).
        time.sleep(0.5)
        assert _scrub(daemon)["passes"] == rested["passes"]
        out = run_cli("status", "--socket", str(daemon.socket)).stdout
        assert "scrub       resting: every cached blob scrubbed" in out, out

        # A blob coming in ends the rest.
        with daemon.client() as c:
            c.experts(TINY_REPO, layer, [7])
        _until(lambda: _scrub(daemon)["passes"] > rested["passes"])
    finally:
        daemon.cleanup()
