"""A command's numbers are checked as its command line is parsed, before any work: zero, negative
and out-of-range values end in argparse's one line naming the flag (exit 2), never a hang (`run
--prefill-step-size 0` waited forever) or a traceback (`run --max-tokens 0`). The socket names
no daemon, so a command that got past its checks would say `daemon_unavailable` (exit 3)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness import run_cli

CASES = [
    (["run", "--prompt", "hi", "--prefill-step-size", "0"], "--prefill-step-size", "at least 1"),
    (["run", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens", "at least 1"),
    (["run", "--prompt", "hi", "--top-p", "1.5"], "--top-p", "from 0 to 1"),
    (["run", "--prompt", "hi", "--temp", "-1"], "--temp", "at least 0"),
    (["openai", "--decode-concurrency", "0"], "--decode-concurrency", "at least 1"),
    (["warm", "--top", "-4"], "--top", "at least 1"),
    (["plan", "--tokens", "0"], "--tokens", "at least 1"),
]


@pytest.mark.parametrize(("argv", "flag", "wanted"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_bad_number_is_one_line_naming_the_flag(tmp_path: Path, argv: list[str], flag: str,
                                                   wanted: str) -> None:
    proc = run_cli(*argv, "--socket", str(tmp_path / "none.sock"), check=False, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.search(rf"cachecd {argv[0]}: error: argument {flag}\S*: must be {wanted}, not ",
                     last), last
