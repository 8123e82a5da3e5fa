"""Ordinary mistakes end in one line naming what failed and what to do, never a traceback.

`cachecd setup --stream` run as a user runs it, against `cachecd hub serve` (one plain, one that
wants a token and gates the tiny repo), a port nothing listens on, and offline mode with an empty
Hugging Face cache. With `-v` the traceback is printed too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachecd.lanhub.server import spawn_hub
from tests.harness import CACHECD, TINY_REPO, HubProcess, free_port, run_cli, short_tmp

TOKEN = "hf_test_token_for_the_gated_hub"


@pytest.fixture(scope="module")
def gated_hub(hub_root: Path) -> Iterator[str]:
    """A hub that wants TOKEN and answers for the tiny repo as the Hub does for a gated repo."""
    proc, url = spawn_hub(hub_root, token=TOKEN, extra_args=["--gated", TINY_REPO])
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def home() -> Iterator[Path]:
    """An empty HF_HOME (no stored token, nothing cached) and the dirs setup would use."""
    base = short_tmp("cde")
    yield base
    shutil.rmtree(base, ignore_errors=True)


def setup(home: Path, spec: str, endpoint: str, *extra: str, env: dict[str, str] | None = None,
          verbose: bool = False) -> subprocess.CompletedProcess[str]:
    env = {"HF_HOME": str(home / "hf"), "HF_TOKEN": "", "HF_HUB_OFFLINE": "0", **(env or {})}
    return run_cli(*(["-v"] if verbose else []), "setup", "--stream", spec, "--endpoint", endpoint,
                   "--socket", str(home / "run" / "s.sock"), "--models-dir", str(home / "models"),
                   "--cache-dir", str(home / "cache"), "--no-start", *extra, env=env,
                   check=False, timeout=120)


def one_line(proc: subprocess.CompletedProcess[str], code: str, exit_code: int = 1) -> str:
    """The single stderr line of a failed command, checked to carry ``code``."""
    assert proc.returncode == exit_code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cachecd: {code}: "), proc.stderr
    return lines[0]


def test_repo_not_found(hub: HubProcess, home: Path) -> None:
    line = one_line(setup(home, "nosuch/repo", hub.url), "not_found")
    assert "nosuch/repo" in line and hub.url in line and "hf auth login" in line


def test_revision_not_found(hub: HubProcess, home: Path) -> None:
    line = one_line(setup(home, f"{TINY_REPO}@nosuch", hub.url), "not_found")
    assert f"{TINY_REPO}@nosuch" in line and "revision" in line


def test_refused_token_is_unauthorized(gated_hub: str, home: Path) -> None:
    line = one_line(setup(home, TINY_REPO, gated_hub, env={"HF_TOKEN": "hf_wrong"}),
                    "unauthorized")
    assert "401" in line and "HF_TOKEN" in line and TINY_REPO in line and "hf_wrong" not in line


def test_gated_repo_says_where_to_ask(gated_hub: str, home: Path) -> None:
    line = one_line(setup(home, TINY_REPO, gated_hub, env={"HF_TOKEN": TOKEN}), "gated")
    assert f"request access at {gated_hub}/{TINY_REPO}" in line and TOKEN not in line


def test_unreachable_endpoint(home: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    line = one_line(setup(home, TINY_REPO, url), "upstream_error")
    assert f"cannot reach {url}" in line and "HF_HUB_OFFLINE=1" in line


def test_offline_with_nothing_cached(hub: HubProcess, home: Path, tiny_manifest: object,
                                     tiny_manifest_path: Path) -> None:
    offline = {"HF_HUB_OFFLINE": "1"}
    line = one_line(setup(home, TINY_REPO, hub.url, env=offline), "offline")
    assert f"{TINY_REPO}@<40-hex commit>" in line
    commit = tiny_manifest.revision  # type: ignore[attr-defined]
    proc = setup(home, f"{TINY_REPO}@{commit}", hub.url, "--manifest", str(tiny_manifest_path),
                 env=offline)
    line = one_line(proc, "offline")
    assert f"{TINY_REPO}@{commit}/config.json" in line and "HF_HUB_OFFLINE" in line


def test_verbose_adds_the_traceback(hub: HubProcess, home: Path) -> None:
    proc = setup(home, "nosuch/repo", hub.url, verbose=True)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "RepositoryNotFoundError" in proc.stderr
    lines = proc.stderr.splitlines()  # debug lines may follow (connections closed at exit)
    assert any(line.startswith("cachecd: not_found: nosuch/repo") for line in lines)


def test_no_daemon_is_one_line_and_its_own_exit_code(home: Path) -> None:
    for argv in (["status"], ["warm", "--model", TINY_REPO, "--top", "5"]):
        proc = run_cli(*argv, "--socket", str(home / "none.sock"), check=False)
        line = one_line(proc, "daemon_unavailable", exit_code=3)  # scripts: "start one"
        assert "cachecd serve" in line


def test_fsck_of_a_cache_a_daemon_holds_is_busy_not_corrupt(daemon: Any) -> None:
    proc = run_cli("fsck", "--cache-dir", str(daemon.cache_dir), check=False)
    assert proc.returncode == 6, (proc.returncode, proc.stderr)  # 1 is corrupt, 4 unverifiable
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("cachecd: cache_locked: ") and "cachecd status" in line, line
    daemon.stop()
    assert run_cli("fsck", "--cache-dir", str(daemon.cache_dir), check=False).returncode == 0


def test_a_config_file_named_by_cachecd_config_must_be_there(tmp_path: Path) -> None:
    gone = tmp_path / "typo.toml"
    proc = run_cli("status", env={"CACHECD_CONFIG": str(gone)}, check=False)
    line = one_line(proc, "config_invalid")
    assert str(gone) in line and "CACHECD_CONFIG" in line


def test_a_file_given_as_the_cache_dir_is_named_as_not_a_directory(tmp_path: Path) -> None:
    a_file = tmp_path / "cache"
    a_file.write_text("not a folder")
    for argv in (["serve", "--socket", str(tmp_path / "s.sock")], ["fsck"]):
        proc = run_cli(*argv, "--cache-dir", str(a_file), check=False)
        line = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == (4 if argv == ["fsck"] else 1), proc.stderr
        assert line.startswith("cachecd: config_invalid: --cache-dir: ") and str(a_file) in line
        assert "is a file, not a directory" in line and "Traceback" not in proc.stderr


def test_the_models_dir_is_where_help_says(tmp_path: Path) -> None:
    """Given a cache dir and no models dir, the models dir is models/ beside it, as --help says
    (and `cachecd status` shows it)."""
    assert "models/ beside the first one (DIR/../models)" in " ".join(
        run_cli("serve", "--help").stdout.split())
    base = short_tmp("cdmd")
    sock, cache = base / "run" / "s.sock", base / "ssd" / "cache"
    proc = subprocess.Popen([*CACHECD, "serve", "--cache-dir", str(cache), "--socket", str(sock)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "CACHECD_CONFIG": str(_empty(base / "c.toml")),
                                 "HOME": str(base / "home")})
    try:
        out = ""
        for _ in range(200):
            status = run_cli("status", "--socket", str(sock), check=False)
            if status.returncode == 0:
                out = status.stdout
                break
            time.sleep(0.1)
        assert f"models      {base / 'ssd' / 'models'}" in out, out
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(base, ignore_errors=True)


def _empty(path: Path) -> Path:
    path.touch()
    return path


def test_a_path_that_cannot_be_used_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    out = tmp_path / "a-file" / "model"
    line = one_line(run_cli("tiny-model", str(out), check=False), "enotdir")
    assert str(out) in line and "Not a directory" in line
    verbose = run_cli("-v", "tiny-model", str(out), check=False)
    assert verbose.returncode == 1 and "NotADirectoryError" in verbose.stderr


def test_fsck_of_a_cache_dir_that_is_not_there_checks_nothing_and_says_so(tmp_path: Path) -> None:
    none = tmp_path / "no-cache"
    proc = run_cli("fsck", "--cache-dir", str(none), check=False)
    assert proc.returncode == 4, proc.stderr  # nothing could be verified
    assert f"no cache dir at {none}" in proc.stderr and "Traceback" not in proc.stderr
    assert not none.exists()  # not made by looking


def test_offline_takes_the_one_installed_revision(hub: HubProcess, home: Path,
                                                  tiny_manifest: object,
                                                  tiny_manifest_path: Path) -> None:
    """Offline, a setup that names no revision (``main``) takes the one revision installed
    before; a branch or tag name is still refused, listing what is installed."""
    from tests.harness import Installed

    commit = tiny_manifest.revision  # type: ignore[attr-defined]
    inst = Installed.setup(hub.url, tiny_manifest_path)
    try:
        args = ["setup", "--stream", TINY_REPO, "--endpoint", hub.url, "--socket",
                str(inst.socket), "--cache-dir", str(inst.base / "cache"), "--models-dir",
                str(inst.base / "models")]
        offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(home / "hf")}
        again = run_cli(*args, env=offline, check=False)
        assert again.returncode == 0, again.stderr
        assert f"{TINY_REPO} is taken at {commit}, the one revision installed" in again.stdout
        args[2] = f"{TINY_REPO}@v2"
        line = one_line(run_cli(*args, env=offline, check=False), "offline")
        assert f"(installed: {commit})" in line
    finally:
        inst.cleanup()
