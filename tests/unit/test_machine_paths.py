"""No tracked file names a path that exists only on one machine: a checkout or venv under the
developers' work dir, root's or a user's home directory.

Such a path works only where it was written, so a fresh clone's CI, or a reader elsewhere,
fails on it. Commands say ``python bench/x.py`` in the README's venv; docs point inside the repo.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Spelled so that this file does not match itself. Not after a word character, a dot or a dash
# (a URL's path, a relative "x/work/"), nor after "~" (the reader's own home is fine).
MACHINE_PATH = re.compile(
    r"(?<![\w.~-])(?:/(?:work|root)/|/(?:home|Users)/[\w.-]+|[A-Za-z]:\\Users\\[\w.-]+)"
)


def machine_paths(text: str) -> list[tuple[int, str]]:
    """(line number, line) for each line of ``text`` that names a machine path."""
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if MACHINE_PATH.search(line)]


def tracked_files() -> list[str]:
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True, timeout=60
    )
    if proc.returncode != 0:
        pytest.skip(
            f"{ROOT} is not a git checkout, no tracked files to scan: {proc.stderr.strip()}"
        )
    return [name for name in proc.stdout.split("\0") if name]


@pytest.mark.parametrize(
    "text",
    [
        "/" + "work/venv/bin/python bench/hits.py",
        "the list is in /" + "work/shared/RELIABILITY.md.",
        'exe = "/' + 'root/.pyenv/shims/python3"',
        "cd /" + "home/alice/src/cachecd",
        "(/" + "Users/bob/cachecd)",
        "C:" + "\\Users\\carol\\cachecd",
    ],
)
def test_matcher_finds_machine_paths(text: str) -> None:
    found = machine_paths("first line\n" + text)
    assert len(found) == 1 and found[0][0] == 2, found


@pytest.mark.parametrize(
    "text",
    [
        "~/.cache/cachecd/run/cachecd.sock",
        "--dir /tmp, /dev/shm, /usr/bin/python3, /etc/passwd",
        "https://example.org/home/index.html",
        "bench/work/x and network/root/y",
        "/homework/ and /rooted/",
    ],
)
def test_matcher_leaves_other_paths(text: str) -> None:
    assert machine_paths(text) == []


def test_no_tracked_file_names_a_machine_path() -> None:
    names = tracked_files()
    scanned, hits = 0, []
    for name in names:
        path = ROOT / name
        if not path.is_file():  # deleted in the work tree, not yet in the index
            continue
        data = path.read_bytes()
        scanned += 1
        if b"\0" in data[:8192]:  # binary
            continue
        text = data.decode("utf-8", "replace")
        hits += [f"{name}:{n}: {line.strip()[:160]}" for n, line in machine_paths(text)]
    # A scan of nothing would pass; these files exist in every checkout of this repository.
    assert scanned >= 50 and {"README.md", "tests/unit/test_machine_paths.py"} <= set(names)
    assert not hits, "paths of one machine in tracked files:\n" + "\n".join(hits)
