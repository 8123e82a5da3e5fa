"""`cachecd setup --stream` checks that the model can be streamed, and that the disk holds what a
step writes, before the step: a repo whose config.json names a model type the engine cannot run
is refused before a manifest build reads a byte of a shard, and a models dir too small for the
resident weights before they start. Run as a user runs it, against `cachecd hub serve`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachecd import constants
from tests.harness import TINY_REPO, HubProcess, LoggedHub, run_cli, short_tmp

QWEN = "cachecd/tiny-qwen3-moe"


@pytest.fixture(scope="module")
def qwen_hub() -> Iterator[LoggedHub]:
    """A hub with the tiny model under another name, its config.json saying qwen3_moe."""
    from cachecd.testbed.tiny_model import write_tiny_model

    root = short_tmp("cdqh")
    repo = write_tiny_model(root / QWEN)
    config = json.loads((repo / "config.json").read_text())
    (repo / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_moe"}))
    hub = LoggedHub(root)
    yield hub
    hub.stop()
    shutil.rmtree(root, ignore_errors=True)


def setup(base: Path, repo: str, endpoint: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("setup", "--stream", repo, "--endpoint", endpoint, "--socket",
                   str(base / "s.sock"), "--models-dir", str(base / "models"), "--cache-dir",
                   str(base / "cache"), "--no-start", *extra, check=False, timeout=300)


def test_an_unsupported_model_type_is_refused_before_any_shard_is_read(
        qwen_hub: LoggedHub) -> None:
    base = short_tmp("cdqs")
    mark = qwen_hub.mark()
    proc = setup(base, QWEN, qwen_hub.url, "--build-manifest")
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("cachecd: unsupported_format: ") and "qwen3_moe" in line, line
    assert ", ".join(constants.SUPPORTED_MODEL_TYPES) in line, line
    read = [path for _, path, _ in qwen_hub.requests(mark) if path.endswith(".safetensors")]
    assert read == [], read  # no manifest build, no resident install
    assert not (base / "models" / QWEN).exists()


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 1 MiB tmpfs: room for setup's small files and kept headers, not the tiny model's 1.9 MB
    of resident weights."""
    root = short_tmp("cdsd")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(root)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    yield root
    subprocess.run(["umount", "-l", str(root)], check=False)


def test_a_disk_too_small_for_the_resident_weights_is_refused_before_they_start(
        hub: HubProcess, tiny_manifest_path: Path, small_disk: Path) -> None:
    base = short_tmp("cdss")
    proc = run_cli("setup", "--stream", TINY_REPO, "--endpoint", hub.url, "--socket",
                   str(base / "s.sock"), "--models-dir", str(small_disk / "models"),
                   "--cache-dir", str(base / "cache"), "--manifest", str(tiny_manifest_path),
                   "--no-start", check=False, timeout=300)
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("cachecd: disk_full: the resident install needs "), line
    assert "--models-dir" in line, line
    left = [p.name for p in (small_disk / "models").rglob("model-resident*")]
    assert left == [], left  # not a byte of the resident weights was written
    assert os.statvfs(small_disk).f_bfree > 0
