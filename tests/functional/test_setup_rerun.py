"""`cachecd setup --stream` on the second day, as a user runs it with its output in a file: a
model no manifest ships for, installed once with --build-manifest, then set up again with no
flag and with the same flag. The second run reuses what the first stored (no second pass over
the revision: the hub sees no read of a shard), and neither writes log lines or progress bars
into a file (only `-v` adds log lines)."""

from __future__ import annotations

import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachecd.errors import DaemonUnavailable
from tests.harness import LoggedHub, run_cli, short_tmp, stop_daemon

REPO = "me/tiny-unshipped"  # no manifest ships for it (manifests/ has the tiny-k3's only)


@pytest.fixture(scope="module")
def own_hub() -> Iterator[LoggedHub]:
    from cachecd.testbed.tiny_model import write_tiny_model

    root = short_tmp("cdrr")
    write_tiny_model(root / REPO, seed=1, layers=3, experts=8)
    hub = LoggedHub(root)
    yield hub
    hub.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def base() -> Iterator[Path]:
    path = short_tmp("cdrs")
    yield path
    try:
        stop_daemon(path / "run" / "s.sock")
    except DaemonUnavailable:
        pass
    shutil.rmtree(path, ignore_errors=True)


def setup(hub: LoggedHub, base: Path, *extra: str) -> tuple[str, str]:
    proc = run_cli(*extra[:1] if extra[:1] == ("-v",) else (), "setup", "--stream", REPO,
                   "--endpoint", hub.url, "--socket", str(base / "run" / "s.sock"),
                   "--cache-dir", str(base / "cache"), "--models-dir", str(base / "models"),
                   *(e for e in extra if e != "-v"))
    return proc.stdout, proc.stderr


def shards_read(hub: LoggedHub, since: int) -> list[str]:
    """Safetensors files the hub served bytes of (a whole file or a range), from ``since``."""
    return [path for method, path, status in hub.requests(since)
            if method == "GET" and path.endswith(".safetensors") and status in (200, 206)]


def test_setup_again_reuses_what_it_stored(own_hub: LoggedHub, base: Path) -> None:
    mark = own_hub.mark()
    out, err = setup(own_hub, base, "--build-manifest")
    assert shards_read(own_hub, mark), "the first run reads the revision (the build)"
    # Not a terminal: no log lines, no progress bars; only what the user must read.
    assert " INFO " not in err and "hashing" not in err and "%|" not in err, err
    assert "installed" in out and "started a daemon" in out
    hint = [line for line in out.splitlines() if "service" in line]
    assert len(hint) == 1 and len(hint[0]) < 200, out  # one line, not a paragraph

    for again in ((), ("--build-manifest",)):
        mark = own_hub.mark()
        out, err = setup(own_hub, base, *again)
        assert "stored by an earlier setup" in out, (again, out)
        assert not shards_read(own_hub, mark), (again, "a second pass over the revision")
        assert "installed" in out and "fetched 0 B now" in out, out
        assert err == "", err


def test_verbose_setup_logs(own_hub: LoggedHub, base: Path) -> None:
    _, err = setup(own_hub, base, "-v", "--build-manifest")
    assert " DEBUG " in err and " INFO " in err, err


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode)
            for p in [root, *root.rglob("*")] if not p.is_symlink()}


def test_installed_weights_are_as_private_as_the_cache(own_hub: LoggedHub, base: Path) -> None:
    """The resident weights, config and tokenizer of an install: directories 0700, files 0600,
    as the expert cache's blobs; an install an older cachecd left readable by all (0755/0644)
    is made so by the next setup."""
    setup(own_hub, base, "--build-manifest")
    installs = base / "models" / REPO.split("/")[0]
    assert stat.S_IMODE((base / "cache" / "blobs").stat().st_mode) == 0o700
    modes = _modes(installs)
    assert any(name.endswith("model-resident.safetensors") for name in modes), modes
    wrong = {n: f"{m:o}" for n, m in modes.items()
             if m != (0o700 if (installs / n).is_dir() else 0o600)}
    assert not wrong, wrong
    for p in [installs, *installs.rglob("*")]:  # as an older cachecd left them
        p.chmod(0o755 if p.is_dir() else 0o644)
    setup(own_hub, base)
    again = _modes(installs)
    wrong = {n: f"{m:o}" for n, m in again.items()
             if m != (0o700 if (installs / n).is_dir() else 0o600)}
    assert not wrong, wrong


def test_status_says_a_reused_manifest_was_built_here(own_hub: LoggedHub, base: Path) -> None:
    """The second setup reuses the manifest the first built: `status` must not call it shipped
    (a trust label must be true)."""
    setup(own_hub, base, "--build-manifest")
    setup(own_hub, base)
    out = run_cli("status", "--socket", str(base / "run" / "s.sock")).stdout
    line = next(x for x in out.splitlines() if x.strip().startswith("manifest"))
    assert "built on this machine" in line and "shipped" not in line, out
