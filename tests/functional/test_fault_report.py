"""The fault suite's report goes only where a command asks: a full run of tests/faults, as a
contributor starts it, leaves the checkout as it was (it used to rewrite docs/RELIABILITY.md).

The full run here is the real suite collected by real pytest, its tests' bodies and fixtures
replaced by a plugin so each passes at once: what is checked is the session-finish hook that
decides where the figures go, not the scenarios (they have their own tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACKED = ROOT / "docs" / "RELIABILITY.md"

# Every collected test passes without running its fixtures or body: a "full run" in seconds.
INSTANT = '''
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    for item in items:
        item.setup = item.runtest = item.teardown = lambda: None
'''


def _full_fault_run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    (tmp_path / "instant_run.py").write_text(INSTANT)
    environ = {k: v for k, v in os.environ.items() if k != "CACHECD_RELIABILITY_REPORT"}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "instant_run", "-p", "no:cacheprovider",
         "tests/faults", *args],
        cwd=ROOT, env={**environ, **(env or {})}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _git_status() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"],
                         capture_output=True, text=True, check=True)
    return out.stdout


@pytest.fixture
def tracked_report() -> bytes:
    """The tracked page's bytes, put back after the test whatever it did to them."""
    before = TRACKED.read_bytes()
    yield before
    if TRACKED.read_bytes() != before:
        TRACKED.write_bytes(before)


def test_a_full_fault_run_writes_nothing_into_the_checkout(
        tmp_path: Path, tracked_report: bytes) -> None:
    status = _git_status()
    out = _full_fault_run(tmp_path)
    assert " passed" in out
    assert TRACKED.read_bytes() == tracked_report, "a plain run rewrote docs/RELIABILITY.md"
    assert _git_status() == status


def test_the_report_is_written_where_the_option_or_the_env_names(
        tmp_path: Path, tracked_report: bytes) -> None:
    by_option, by_env = tmp_path / "option.md", tmp_path / "env.md"
    _full_fault_run(tmp_path, "--reliability-report", str(by_option))
    _full_fault_run(tmp_path, env={"CACHECD_RELIABILITY_REPORT": str(by_env)})
    for report in (by_option, by_env):
        text = report.read_text()
        assert text.startswith("# Reliability: measured")
        assert "test_s04_stall.py" in text and ": passed" in text
    assert TRACKED.read_bytes() == tracked_report
