"""The lower bounds in pyproject.toml are true: the project installs with every dependency at
the lowest release it allows, and the CLI and the unit tests run there.

The run builds a venv from the package registries and runs tests/unit in it, which takes a few
minutes, so it is opt-in: ``.venv/bin/pytest -q tests/install --lowest-deps``. The pins are read
from pyproject.toml for this platform, so a bound raised or added there is what gets checked.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def lowest_pins(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """``name[extras]==lowest`` for each dependency that applies to this platform."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = []
    for text in deps:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        lows = [s.version for s in req.specifier if s.operator in (">=", "==", "~=")]
        assert len(lows) == 1, f"{text!r}: a dependency needs exactly one lower bound (>=)"
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        pins.append(f"{req.name}{extras}=={lows[0]}")
    return pins


def test_every_dependency_has_one_lower_bound_to_pin() -> None:
    pins = lowest_pins()
    names = {Requirement(p).name.lower().replace("_", "-") for p in pins}
    assert {"huggingface-hub", "safetensors", "aiohttp", "mlx-lm"} <= names
    assert all("==" in p for p in pins)


def _run(argv: list[str], what: str, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    assert proc.returncode == 0, (f"{what} exited {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}"
                                  f"\nstderr:\n{proc.stderr[-6000:]}")
    return proc


def test_lowest_allowed_versions_install_and_pass_the_unit_tests(request: pytest.FixtureRequest,
                                                                 tmp_path: Path) -> None:
    if not request.config.getoption("--lowest-deps"):
        pytest.skip("opt-in, a few minutes (a venv from the package registries with every "
                    "dependency at its lowest allowed release, then tests/unit in it): "
                    "pytest tests/install --lowest-deps")
    env_dir = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(env_dir)], "python -m venv")
    py = env_dir / "bin" / "python"
    pins = lowest_pins()
    _run([str(py), "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]", *pins],
         f"pip install {' '.join(pins)}", timeout=1800)
    freeze = _run([str(py), "-m", "pip", "freeze"], "pip freeze").stdout.lower().replace("_", "-")
    for pin in pins:
        assert _installed(freeze, Requirement(pin)), f"{pin} is not what got installed:\n{freeze}"
    _run([str(env_dir / "bin" / "cachecd"), "--help"], "cachecd --help")
    _run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit"],
         "tests/unit under the lowest versions", cwd=ROOT, timeout=1800)


def _installed(freeze: str, req: Requirement) -> bool:
    """Whether ``pip freeze`` lists the pinned release (it writes 3.11.0 for a pin of 3.11)."""
    from packaging.version import Version

    name = req.name.lower().replace("_", "-")
    want = Version(next(iter(req.specifier)).version)
    for line in freeze.splitlines():
        got_name, sep, got = line.partition("==")
        if sep and got_name.split("[")[0] == name:
            return Version(got) == want
    return False
