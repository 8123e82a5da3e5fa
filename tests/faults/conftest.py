"""Fixtures of the fault suite and the hook that writes its figures where a run is asked to.

Daemons made through ``daemons``/``module_daemons`` are finished at teardown with the global
invariant (``FaultDaemon.finish``). The report is written only where ``--reliability-report PATH``
(or $CACHECD_RELIABILITY_REPORT) names, so a plain run never writes into the checkout, and only
when every scenario module ran and nothing was deselected, so a partial run never overwrites the
record of a full one. ``pytest tests/faults --reliability-report docs/RELIABILITY.md`` renews the
tracked page.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.fake_hub import FakeHub
from tests.faults.figures import FIGURES
from tests.faults.hubs import HubThread, RecordingHub
from tests.faults.support import FaultDaemon, Model, build_model, new_dir

FIGURES.add("all.bad_bytes_served", 0)  # a measured 0, listed even when nothing went wrong
HERE = Path(__file__).parent
_state: dict[str, Any] = {"collected": set(), "deselected": 0, "t0": None, "t1": None}


# -- models -------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def fault_root() -> Iterator[Path]:
    root = new_dir("cdfr")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def small(fault_root: Path) -> Model:
    """160 experts of 6.5 KB in 12 shards (4 experts split across shards)."""
    return build_model(fault_root, "faults/small")


@pytest.fixture(scope="session")
def small_other(fault_root: Path) -> Model:
    """The same repo and layout with other bytes: what another revision looks like."""
    return build_model(fault_root / "other", "faults/small", seed=1)


@pytest.fixture(scope="session")
def big(fault_root: Path) -> Model:
    """48 experts of ~1 MiB (1,044,480 bytes) for budget and disk-full scenarios."""
    return build_model(fault_root, "faults/big", experts=16, layers=4, expert_hidden=1024,
                       moe_intermediate=640, shard_bytes=8 << 20)


# -- hubs and daemons ---------------------------------------------------------------------------
class _Pool:
    def __init__(self) -> None:
        self.hubs: list[HubThread] = []
        self.daemons: list[FaultDaemon] = []

    def hub(self, model: Model) -> FakeHub:
        return self.hub_thread(model).hub

    def hub_thread(self, model: Model, hub_cls: type[RecordingHub] = RecordingHub) -> HubThread:
        t = HubThread(model.folder, repo=model.repo, revision=model.revision)
        t.hub_cls = hub_cls
        t.start()
        self.hubs.append(t)
        return t

    def daemon(self, endpoint: str | FakeHub, models: list[Model], *, start: bool = True,
               **kw: Any) -> FaultDaemon:
        url = endpoint.url if isinstance(endpoint, FakeHub) else endpoint
        d = FaultDaemon(url, models, **kw)
        self.daemons.append(d)
        return d.start() if start else d

    def close(self) -> None:
        failures = []
        for d in self.daemons:
            try:
                d.finish()
            except AssertionError as exc:
                failures.append(exc)
        for t in self.hubs:
            t.stop()
        if failures:
            raise failures[0]


@pytest.fixture
def pool() -> Iterator[_Pool]:
    p = _Pool()
    yield p
    p.close()


@pytest.fixture(scope="module")
def module_pool() -> Iterator[_Pool]:
    p = _Pool()
    yield p
    p.close()


@pytest.fixture
def hub_for(pool: _Pool) -> Callable[[Model], FakeHub]:
    return pool.hub


@pytest.fixture
def daemons(pool: _Pool) -> Callable[..., FaultDaemon]:
    return pool.daemon


# -- figures and the report ---------------------------------------------------------------------
def _is_fault_item(nodeid: str) -> bool:
    return nodeid.replace("\\", "/").startswith("tests/faults/")


SOAK_LONG_S = 600.0  # --soak: the opt-in soak, ten minutes


def soak_seconds(config: pytest.Config) -> float:
    """--soak-seconds, else $CACHECD_SOAK_SECONDS, else ten minutes with --soak, else 60: a
    minute keeps the suite short."""
    given = config.getoption("--soak-seconds", None)
    if given is None:
        given = os.environ.get("CACHECD_SOAK_SECONDS")
    if given is None:
        given = SOAK_LONG_S if config.getoption("--soak", False) else 60.0
    return float(given)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _state["collected"] = {i.nodeid for i in items if _is_fault_item(i.nodeid)}
    for item in items:  # a longer soak gets a longer timeout than the suite's 300 s
        if "test_s17_soak" in item.nodeid:
            item.add_marker(pytest.mark.timeout(soak_seconds(config) + 240))


def pytest_deselected(items: list[pytest.Item]) -> None:
    _state["deselected"] += sum(1 for i in items if _is_fault_item(i.nodeid))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not _is_fault_item(report.nodeid):
        return
    now = time.time()
    _state["t0"] = _state["t0"] or now - report.duration
    _state["t1"] = now
    FIGURES.add("all.test_seconds", report.duration)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else "skipped"
            FIGURES.outcomes[report.nodeid] = f"skipped: {reason}"
        else:
            FIGURES.outcomes[report.nodeid] = report.outcome
    elif report.when == "teardown" and report.failed:
        FIGURES.outcomes[report.nodeid] = "failed (invariant at teardown)"


def report_path(config: pytest.Config) -> Path | None:
    """--reliability-report, else $CACHECD_RELIABILITY_REPORT, else None: figures go only where
    a command asked for them (a relative path is taken from the directory pytest ran in)."""
    given = config.getoption("--reliability-report", None)
    if given is None:
        given = os.environ.get("CACHECD_RELIABILITY_REPORT") or None
    return Path(given).absolute() if given else None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests.faults.write_report import write_report

    report = report_path(session.config)
    if report is None:
        return
    collected: set[str] = _state["collected"]
    modules = {n.split("::")[0].rsplit("/", 1)[-1] for n in collected}
    every_module = {p.name for p in HERE.glob("test_s*.py")}
    full = (bool(collected) and modules == every_module and not _state["deselected"]
            and collected <= set(FIGURES.outcomes) and exitstatus != pytest.ExitCode.INTERRUPTED)
    if full:
        wall = (_state["t1"] or 0) - (_state["t0"] or 0)
        write_report(report, FIGURES, wall)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _state["collected"]:
        return
    terminalreporter.section("fault suite figures")
    for key, value in sorted(FIGURES.values.items()):
        terminalreporter.write_line(f"{key} = {value}")
