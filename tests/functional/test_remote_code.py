"""Every code file a repo's ``auto_map`` names is pinned, listed, and checked where it is imported.

A Kimi-style tiny repo (tiktoken tokenizer with remote code) whose config.json also names its own
``configuration_kimi.py`` in ``auto_map.AutoConfig``, as Kimi's and DeepSeek's repos do:
transformers imports that file too when the trusted tokenizer loads (AutoTokenizer builds the
config first), from the copy it keeps in its modules cache. Served by `cachecd hub serve`,
installed by `cachecd setup --stream`, run by `cachecd run --trust-remote-code` as a user runs
them. An edit to that file, in the install dir or in the modules cache (same size and mtime, which
transformers does not notice), is refused before it runs: the edit would write a marker file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import py_compile
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness import HubProcess, Installed, run_cli, short_tmp

REPO = "moonshot-like/tiny-kimi-config"
CODE = "configuration_kimi.py"
LINE = 200  # the line an edit replaces, at the same length
CONFIG_SOURCE = '''"""A tiny Kimi-style config class, named by config.json's auto_map."""

from transformers.configuration_utils import PreTrainedConfig

{line}


class KimiK3Config(PreTrainedConfig):
    model_type = "kimi_k3"
'''


@dataclass
class Repo:
    inst: Installed
    local: Path  # the install dir
    env: dict[str, str]
    marker: Path
    setup_first: str  # setup without trust
    setup_second: str  # with it

    def sha(self, name: str) -> str:
        return hashlib.sha256((self.local / name).read_bytes()).hexdigest()

    def run(self) -> Any:
        return run_cli("run", "--model", REPO, "--socket", str(self.inst.socket),
                       "--trust-remote-code", "--prompt", "hi", "--max-tokens", "1",
                       env=self.env, check=False)


def _line(text: str) -> str:
    assert len(text) <= LINE
    return text + " " * (LINE - len(text) - 2) + "#\n" if len(text) < LINE - 2 else text


@pytest.fixture(scope="module")
def repo() -> Iterator[Repo]:
    root, work = short_tmp("cdrc"), short_tmp("cdrcw")
    run_cli("tiny-model", str(root / REPO), "--kimi-tokenizer")
    (root / REPO / CODE).write_text(CONFIG_SOURCE.format(line=_line("MARK = 0")))
    config = json.loads((root / REPO / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_kimi.KimiK3Config"}
    (root / REPO / "config.json").write_text(json.dumps(config, indent=2))
    env = {"HF_HOME": str(work / "hf"), "HF_MODULES_CACHE": str(work / "modules")}
    hub = HubProcess(root)
    inst = Installed(short_tmp("cdrci"))
    try:
        manifest = work / "kimi.manifest"
        run_cli("manifest", "build", f"{REPO}@main", "--endpoint", hub.url, "--output",
                str(manifest))
        common = ["--stream", REPO, "--endpoint", hub.url, "--socket", str(inst.socket),
                  "--cache-dir", str(inst.base / "cache"), "--models-dir",
                  str(inst.base / "models"), "--manifest", str(manifest)]
        first = run_cli("setup", *common, env=env).stdout
        second = run_cli("setup", *common, "--trust-remote-code", env=env).stdout
        local = next((inst.base / "models" / REPO).iterdir())
        yield Repo(inst, local, env, work / "ran", first, second)
    finally:
        inst.cleanup()
        hub.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def _edit(path: Path, marker: Path, mtime_of: Path | None = None) -> None:
    """The marker-writing line in place of the harmless one: same size, and the mtime of
    ``mtime_of`` (the installed file, for a modules-cache copy: then transformers' shallow
    comparison takes the two for equal and does not copy again), else its own."""
    st = path.stat()
    text = path.read_text()
    evil = _line(f"MARK = __import__('pathlib').Path({str(marker)!r}).write_text('ran')")
    path.write_text(text.replace(_line("MARK = 0"), evil))
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, (mtime_of.stat() if mtime_of else st).st_mtime_ns))


def _one_line(proc: Any, code: str) -> str:
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("cachecd: ")]
    assert len(lines) == 1 and lines[0].startswith(f"cachecd: {code}: "), proc.stderr[-3000:]
    return lines[0]


def test_every_auto_map_file_is_pinned_and_listed(repo: Repo) -> None:
    listed = (f"{CODE} (sha256 {repo.sha(CODE)}), tokenization_kimi.py "
              f"(sha256 {repo.sha('tokenization_kimi.py')})")
    assert f"the tokenizer runs code from the repo: {listed}, pinned by the manifest" in \
        repo.setup_first
    assert f"tokenizer: ran {listed}: 640 ids" in repo.setup_second
    proc = repo.run()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"before it is imported: {listed}" in proc.stderr
    cached = list(Path(repo.env["HF_MODULES_CACHE"]).rglob(CODE))
    assert cached, "transformers imported the config's code from its modules cache"


def test_an_edited_file_in_the_install_dir_is_refused(repo: Repo) -> None:
    path = repo.local / CODE
    saved = path.read_bytes()
    _edit(path, repo.marker)
    try:
        line = _one_line(repo.run(), "remote_code_mismatch")
        assert str(path) in line and "setup --stream" in line
        assert not repo.marker.exists(), "the edited code ran"
    finally:
        path.write_bytes(saved)


def test_an_edited_copy_in_the_modules_cache_is_refused(repo: Repo) -> None:
    assert repo.run().returncode == 0  # transformers' copies are in place
    (cached,) = Path(repo.env["HF_MODULES_CACHE"]).rglob(CODE)
    saved = cached.read_bytes()
    _edit(cached, repo.marker, mtime_of=repo.local / CODE)
    try:
        line = _one_line(repo.run(), "remote_code_mismatch")
        assert str(cached) in line and "nothing of it ran" in line
        assert not repo.marker.exists(), "the edited copy ran"
    finally:
        cached.write_bytes(saved)
    assert repo.run().returncode == 0


def test_a_planted_pyc_beside_a_pinned_copy_never_runs(repo: Repo) -> None:
    """Bytecode in the modules cache's ``__pycache__`` built from an edited source, beside a copy
    whose .py still has the pinned sha256: an unchecked-hash .pyc, which Python's own loader
    runs without looking at the source. What runs is the pinned source: the run succeeds and the
    edit, which would write a marker file, never runs."""
    assert repo.run().returncode == 0  # transformers' copies are in place
    (cached,) = Path(repo.env["HF_MODULES_CACHE"]).rglob(CODE)
    evil = repo.marker.parent / "evil" / CODE
    evil.parent.mkdir(exist_ok=True)
    shutil.copy2(cached, evil)
    _edit(evil, repo.marker)
    modules = Path(repo.env["HF_MODULES_CACHE"])
    # The module's own .pyc, and one for each package above it (transformers writes their
    # __init__.py empty; importing the module the usual way would run them first).
    sources = [cached, *(p for p in modules.rglob("__init__.py") if cached.is_relative_to(p.parent))]
    pycs = [Path(importlib.util.cache_from_source(str(f))) for f in sources]
    for f, pyc in zip(sources, pycs, strict=True):
        py_compile.compile(str(evil), cfile=str(pyc), dfile=str(f), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    try:
        proc = repo.run()
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not repo.marker.exists(), "the planted bytecode ran"
        assert hashlib.sha256(cached.read_bytes()).hexdigest() == repo.sha(CODE)
    finally:
        for pyc in pycs:
            pyc.unlink(missing_ok=True)
        repo.marker.unlink(missing_ok=True)
