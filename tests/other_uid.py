"""Run Python as another uid from a test, with an interpreter and packages that uid can read.

The test's own interpreter and packages may sit where only their owner can reach them (a pyenv
under a 0700 home, a checkout or venv under a 0700 temp dir), so another uid cannot use them, and
``python3`` on PATH may be a shim it cannot execute. ``prepare`` derives what that uid needs from
the test's own environment: it runs a probe of the program in this interpreter to learn the
packages it imports, copies them into a world-readable temp dir, and picks an interpreter the uid
can execute with this one's X.Y and extension ABI that imports the copies. The uid runs it with
``-S`` so nothing but the stdlib and the copies is on its path. When no such pair exists, the test
is skipped with the reason each candidate failed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

NOBODY = 65534
_SELF = f"{sys.version_info[0]}.{sys.version_info[1]} {sysconfig.get_config_var('EXT_SUFFIX')}"
_SELF_CODE = (
    "import sys, sysconfig; print(f'{sys.version_info[0]}.{sys.version_info[1]} "
    '{sysconfig.get_config_var("EXT_SUFFIX")}\')'
)
# Runs ``-c CODE ...`` or ``-m MODULE ...`` as python would, then lists sys.modules's new names.
_PROBE_CODE = """
import atexit, runpy, sys
out, mode, what, *rest = sys.argv[1:]
seen = set(sys.modules)
atexit.register(lambda: open(out, "w").write("\\n".join(set(sys.modules) - seen)))
sys.argv = [mode if mode == "-c" else what, *rest]
if mode == "-m":
    runpy.run_module(what, run_name="__main__", alter_sys=True)
else:
    exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})
"""
_IMPORT_CODE = "import importlib, sys\nfor n in sys.argv[1:]: importlib.import_module(n)"


@dataclass(frozen=True)
class OtherUid:
    """How to start Python as ``uid``: ``argv(...)`` under ``env(...)``, from cwd ``/``."""

    uid: int
    python: str
    site: Path  # the copied packages, world-readable; empty for stdlib-only programs

    def argv(self, *args: str) -> list[str]:
        return [
            "setpriv",
            f"--reuid={self.uid}",
            f"--regid={self.uid}",
            "--clear-groups",
            self.python,
            "-S",
            "-B",
            *args,
        ]

    def env(self, **extra: str) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", os.defpath), "PYTHONPATH": str(self.site), **extra}


def prepare(uid: int, probe: Sequence[str], root: Path) -> OtherUid:
    """``probe``: ``-c CODE ...`` or ``-m MODULE ...`` for this interpreter, a run (exit 0) that
    imports what the uid's run will, lazy imports included, e.g. the same command run here
    first; empty when the program needs only the stdlib. ``root``: a new dir to fill."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root to run a program as uid {uid} (running as uid {os.geteuid()})")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) on PATH to run a program as another uid")
    site = root / "site"
    site.mkdir(parents=True)
    tops = _copy_imports(probe, site) if probe else []
    _open_up(root)
    tried = []
    for python in _candidates():
        out = _run_as(uid, [python, "-S", "-c", _SELF_CODE], site)
        if out.returncode != 0 or out.stdout.strip() != _SELF:
            tried.append(f"{python}: exit {out.returncode}, {(out.stdout + out.stderr).strip()!r}")
            continue
        out = _run_as(uid, [python, "-S", "-B", "-c", _IMPORT_CODE, *tops], site)
        if out.returncode == 0:
            return OtherUid(uid, python, site)
        tried.append(f"{python}: cannot import {tops} from {site}: {out.stderr.strip()[-300:]!r}")
    version, suffix = _SELF.split()
    pytest.skip(
        f"found no Python {version} (extensions {suffix}) that uid {uid} can execute and that "
        f"imports this test's packages copied to {site}; tried "
        f"{'; '.join(tried) or 'nothing: no candidate on PATH'}"
    )


def _candidates() -> list[str]:
    """This interpreter (resolved), its base, then pythonX.Y / pythonX / python3 on PATH."""
    x, y = sys.version_info[:2]
    found = [
        os.path.realpath(sys.executable),
        os.path.realpath(getattr(sys, "_base_executable", sys.executable)),
    ]
    for name in (f"python{x}.{y}", f"python{x}", "python3"):
        for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
            path = os.path.join(d or ".", name)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                found.append(path)
    return list(dict.fromkeys(found))


def _run_as(uid: int, argv: list[str], site: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", os.defpath), "PYTHONPATH": str(site)}
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env=env,
    )


def _imported(probe: Sequence[str], out: Path) -> list[str]:
    """Top-level non-stdlib modules this interpreter imports running ``probe`` that it had not
    imported at startup. Read from ``sys.modules`` at exit: ``-X importtime`` misses the modules
    loaded through ``importlib.import_module``, as the cli loads its commands."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE_CODE, str(out), *probe],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert proc.returncode == 0, f"probe {list(probe)} failed here:\n{proc.stderr[-3000:]}"
    stdlib = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
    names = {n.split(".")[0] for n in out.read_text().split()}
    out.unlink()
    return sorted(names - stdlib)


def _copy_imports(probe: Sequence[str], site: Path) -> list[str]:
    """Copy the packages ``probe`` imports into ``site``, with the shared libraries their
    distributions bundle (``numpy.libs``); their names."""
    found = map(_spec, _imported(probe, site.parent / "imported"))
    specs = [s for s in found if s is not None]
    dists = importlib.metadata.packages_distributions()
    for spec in specs:
        if spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                shutil.copytree(
                    loc,
                    site / spec.name,
                    dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"),
                )
        elif spec.origin:
            shutil.copy2(spec.origin, site)
        for f in (f for d in dists.get(spec.name, []) for f in _dist_files(d)):
            if f.parts[0].endswith(".libs"):
                (site / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(str(f.locate())), site / f)
    return [spec.name for spec in specs]


def _spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """None for a module made at run time (``_cython_3_1_4``, ``__mp_main__``): nothing to copy."""
    try:
        return importlib.util.find_spec(name)
    except ValueError:  # in sys.modules here without a spec
        return None


def _dist_files(dist: str) -> Iterator[importlib.metadata.PackagePath]:
    yield from importlib.metadata.distribution(dist).files or []


def _open_up(root: Path) -> None:
    """Directories 0755 and files readable by all, whatever umask the copies came with."""
    for base, _dirs, files in os.walk(root):
        os.chmod(base, 0o755)
        for name in files:
            path = os.path.join(base, name)
            os.chmod(path, os.stat(path).st_mode & 0o7777 | 0o444)


def new_root() -> Path:
    """A new dir for ``prepare`` to fill, under a temp dir the other uid can reach: ``TMPDIR`` may
    be private (pam_tmpdir's ``/tmp/user/UID`` is 0700), then ``/tmp`` or ``/var/tmp``."""
    for base in (tempfile.gettempdir(), "/tmp", "/var/tmp"):
        if _searchable_by_all(Path(base)):
            return Path(tempfile.mkdtemp(prefix="cd-uid", dir=base))
    return Path(tempfile.mkdtemp(prefix="cd-uid"))  # prepare then skips, naming what failed


def _searchable_by_all(path: Path) -> bool:
    """Whether every directory from / down to ``path`` lets any uid through (o+x)."""
    try:
        real = path.resolve(strict=True)
        return all(os.stat(d).st_mode & 0o001 for d in (real, *real.parents))
    except OSError:
        return False
