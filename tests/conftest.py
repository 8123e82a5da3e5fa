"""Session-wide real fixtures: a tiny K3 checkpoint, `cachecd hub serve` over it, its manifest."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness import (
    TINY_REPO,
    DaemonProcess,
    HubProcess,
    Installed,
    remove_short_tmps,
    run_cli,
    short_tmp,
)
from tests.other_uid import NOBODY, OtherUid, new_root, prepare


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.macos("what it checks")``: run on macOS, skipped elsewhere with the reason
    "needs macOS: what it checks", so a Linux run lists what only a Mac run checks."""
    if sys.platform == "darwin":
        return
    for item in items:
        mark = item.get_closest_marker("macos")
        if mark is not None:
            what = mark.args[0] if mark.args else item.name
            item.add_marker(pytest.mark.skip(reason=f"needs macOS: {what}"))


@pytest.fixture(scope="session", autouse=True)
def daemon_log_dir() -> Iterator[Path]:
    """Daemons that `cachecd setup` starts log here, not in the user's own log dir."""
    logs, before = short_tmp("cdlogs"), os.environ.get("CACHECD_LOG_DIR")
    os.environ["CACHECD_LOG_DIR"] = str(logs)
    yield logs
    os.environ.pop("CACHECD_LOG_DIR") if before is None else os.environ.update(CACHECD_LOG_DIR=before)
    shutil.rmtree(logs, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def config_file() -> Iterator[Path]:
    """Commands read an empty config file of the suite's own, and `cachecd setup` records what it
    was told beside it (config.recorded_path), never in the user's ~/.config/cachecd."""
    path, before = short_tmp("cdcfg") / "config.toml", os.environ.get("CACHECD_CONFIG")
    path.write_text("")
    os.environ["CACHECD_CONFIG"] = str(path)
    yield path
    os.environ.pop("CACHECD_CONFIG") if before is None else os.environ.update(CACHECD_CONFIG=before)
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def hub_root() -> Iterator[Path]:
    from cachecd.testbed.tiny_model import write_tiny_model

    root = short_tmp("cdhub")
    write_tiny_model(root / TINY_REPO)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_dir(hub_root: Path) -> Path:
    return hub_root / TINY_REPO


@pytest.fixture(scope="session")
def tiny_resident(tiny_dir: Path):  # type: ignore[no-untyped-def]
    """``mlx_lm.load`` of the tiny checkpoint, every weight resident: the reference."""
    import mlx_lm

    return mlx_lm.load(str(tiny_dir))


@pytest.fixture(scope="session")
def hub(hub_root: Path) -> Iterator[HubProcess]:
    proc = HubProcess(hub_root)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def tiny_manifest_path(hub: HubProcess, hub_root: Path) -> Iterator[Path]:
    out = hub_root.parent / (hub_root.name + "-tiny.manifest")
    run_cli("manifest", "build", f"{TINY_REPO}@main", "--endpoint", hub.url, "--output", str(out))
    yield out
    out.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def tiny_manifest(tiny_manifest_path: Path):  # type: ignore[no-untyped-def]
    from cachecd.manifest.manifest import Manifest

    return Manifest.load(tiny_manifest_path)


@pytest.fixture
def daemon(hub: HubProcess, tiny_manifest_path: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(hub.url, [tiny_manifest_path]).start()
    yield d
    d.cleanup()


@pytest.fixture
def installed(hub: HubProcess, tiny_manifest_path: Path) -> Iterator[Installed]:
    """`cachecd setup --stream` of the tiny model: its resident files and the daemon it started."""
    inst = Installed.setup(hub.url, tiny_manifest_path)
    yield inst
    inst.cleanup()


@pytest.fixture(scope="module")
def installed_module(hub: HubProcess, tiny_manifest_path: Path) -> Iterator[Installed]:
    """``installed``, shared by one test module's tests (each module gets its own daemon)."""
    inst = Installed.setup(hub.url, tiny_manifest_path)
    yield inst
    inst.cleanup()


@pytest.fixture(scope="session")
def as_nobody() -> Iterator[Callable[..., OtherUid]]:
    """``as_nobody(*probe)``: how to run Python as uid 65534 with what ``probe`` imports
    (tests/other_uid.py); skips, saying why, where that cannot be done."""
    made: dict[tuple[str, ...], tuple[Path, OtherUid]] = {}

    def get(*probe: str) -> OtherUid:
        if probe not in made:
            root = new_root()
            try:
                made[probe] = (root, prepare(NOBODY, probe, root))
            except BaseException:
                shutil.rmtree(root, ignore_errors=True)
                raise
        return made[probe][1]

    yield get
    for root, _ in made.values():
        shutil.rmtree(root, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-seconds", type=float, default=None,
        help="how long the fault suite's soak (tests/faults/test_s17_soak.py) keeps the daemon "
             "under load; default $CACHECD_SOAK_SECONDS, else 60")
    parser.addoption(
        "--soak", action="store_true", default=False,
        help="run the fault suite's soak for ten minutes (its leak bound per request tightens "
             "with the requests served); without it, 60 s")
    parser.addoption(
        "--reliability-report", metavar="PATH", default=None,
        help="after a full run of tests/faults, write its figures to PATH (the tracked page is "
             "docs/RELIABILITY.md); default $CACHECD_RELIABILITY_REPORT, else nowhere: no test "
             "writes into the checkout unless asked")
    parser.addoption(
        "--lowest-deps", action="store_true", default=False,
        help="run tests/install: a venv with every dependency at the lowest release "
             "pyproject.toml allows, `cachecd --help` and tests/unit in it (a few minutes)")


def pytest_configure(config: pytest.Config) -> None:
    # The fault suite's figures live in the process that ran its tests: worker processes
    # (pytest-xdist's -n) would each hold a part, and the report would be refused as partial
    # without saying why.
    workers = getattr(config.option, "numprocesses", None)
    asked = config.getoption("--reliability-report") or os.environ.get("CACHECD_RELIABILITY_REPORT")
    if asked and workers and not hasattr(config, "workerinput"):
        raise pytest.UsageError(
            "--reliability-report (or $CACHECD_RELIABILITY_REPORT) renders the figures of one "
            f"process; this run has {workers} workers (-n): add -n 0")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Session fixtures (hubs, daemons) are torn down by now; a failed run keeps its dirs (logs).
    if exitstatus == pytest.ExitCode.OK:
        remove_short_tmps()
