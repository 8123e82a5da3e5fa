"""`--model` may be left out when the daemon has exactly one model registered; with none or
several the command says so in one line, naming the registered ones."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachecd.manifest.manifest import Manifest
from tests.harness import TINY_REPO, DaemonProcess, HubProcess, run_cli

TWIN = "cachecd/tiny-k3-twin"


def test_the_one_registered_model_is_the_default(daemon: DaemonProcess, tiny_manifest: Any) -> None:
    sock = str(daemon.socket)
    layer = tiny_manifest.moe_layers[0]
    out = run_cli("pin", "--socket", sock, "--layer", str(layer), "--experts", "0,1").stdout
    assert out.strip() == f"pinned 2 experts of {TINY_REPO} layer {layer}"
    out = run_cli("coverage", "--socket", sock, "--format", "json").stdout
    assert f'"{TINY_REPO}"' in out
    out = run_cli("warm", "--socket", sock, "--top", "1").stdout
    assert f"of {TINY_REPO};" in out  # nothing recorded yet to warm, but the model is known
    with daemon.client() as c:
        assert c.coverage(TINY_REPO)["experts_cached"] == 2


@pytest.fixture
def offline_daemon(hub: HubProcess) -> Iterator[DaemonProcess]:
    """A daemon that registers manifests without asking the Hub (offline), none at start."""
    d = DaemonProcess(hub.url, args=["--offline"]).start()
    yield d
    d.cleanup()


def one_line(proc: Any, code: str) -> str:
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cachecd: {code}: "), proc.stderr
    return lines[0]


def test_none_or_several_models_is_a_clear_error(offline_daemon: DaemonProcess,
                                                tiny_manifest_path: Path) -> None:
    sock = str(offline_daemon.socket)
    line = one_line(run_cli("coverage", "--socket", sock, check=False), "model_not_found")
    assert "cachecd setup --stream" in line
    twin = offline_daemon.base / "twin.manifest"
    copy = Manifest.load(tiny_manifest_path)
    copy._meta = {**copy._meta, "repo": TWIN}  # the same experts under a second name
    copy.save(twin)
    with offline_daemon.client() as c:
        c.register(tiny_manifest_path)
        c.register(twin)
    for argv in (["coverage"], ["pin", "--layer", "1", "--experts", "0"], ["run", "--prompt", "x"]):
        line = one_line(run_cli(*argv, "--socket", sock, check=False), "invalid_request")
        assert f"({TINY_REPO}, {TWIN})" in line and "--model ORG/NAME" in line, argv
    out = run_cli("coverage", "--socket", sock, "--model", TWIN, "--format", "json").stdout
    assert f'"{TWIN}"' in out
