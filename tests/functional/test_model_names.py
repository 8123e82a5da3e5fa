"""Model names as a user types them: right after ``setup --stream ORG/NAME@v2``, ``run --model
ORG/NAME@v2`` runs that install (the revision name setup was given, or a unique prefix of its
commit, names it); a name that names nothing lists what is registered and the closest name, and
never tells the user to run the setup they just ran."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import TINY_REPO, HubProcess, Installed, run_cli, short_tmp


@pytest.fixture(scope="module")
def v2(tiny_dir: Path) -> Iterator[tuple[Installed, str]]:
    """The tiny model's branch ``v2`` on a hub of its own, installed by its name."""
    root = short_tmp("cdv2")
    shutil.copytree(tiny_dir, root / f"{TINY_REPO}@v2")
    hub = HubProcess(root)
    inst = Installed(short_tmp("cdi"))
    try:
        out = run_cli("setup", "--stream", f"{TINY_REPO}@v2", "--endpoint", hub.url, "--socket",
                      str(inst.socket), "--cache-dir", str(inst.base / "cache"),
                      "--models-dir", str(inst.base / "models")).stdout
        assert "installed" in out, out
        with inst.client() as c:
            commit = c.models()[0]["revision"]
        status = run_cli("status", "--socket", str(inst.socket)).stdout
        assert f"model       {TINY_REPO}@{commit[:12]} (v2) " in status, status
        yield inst, commit
    finally:
        inst.cleanup()
        hub.stop()
        shutil.rmtree(root, ignore_errors=True)


def _run(inst: Installed, model: str, check: bool = True):  # type: ignore[no-untyped-def]
    return run_cli("run", "--model", model, "--socket", str(inst.socket), "--prompt", "Hi",
                   "--max-tokens", "2", "--no-chat", check=check)


@pytest.mark.parametrize("how", ["name", "prefix"])
def test_run_takes_the_revision_setup_was_given(v2: tuple[Installed, str], how: str) -> None:
    inst, commit = v2
    model = f"{TINY_REPO}@v2" if how == "name" else f"{TINY_REPO}@{commit[:9]}"
    proc = _run(inst, model, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), proc.stderr


def test_a_name_that_names_nothing_lists_what_is_registered(v2: tuple[Installed, str]) -> None:
    inst, commit = v2
    proc = _run(inst, f"{TINY_REPO}@v3", check=False)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert f"{TINY_REPO} is not registered at v3" in err, err
    assert f"registered: {TINY_REPO}@{commit[:12]} (v2)" in err, err
    assert f"did you mean {TINY_REPO}@v2?" in err, err
    assert "setup" not in err, err
    proc = _run(inst, "cachecd/tiny-k2", check=False)  # a typo of the repo
    err = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and f"did you mean {TINY_REPO}?" in err, err
    assert "setup" not in err, err
