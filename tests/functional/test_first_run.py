"""The first run on a fresh machine: MLX compiles its CPU kernels while the first layers run, and
`cachecd run` says so once ("compiling kernels (once per machine)") instead of extrapolating a
time left from a layer that read no expert (before: 54 s on layer 1 showed "about 271 s left").
A fresh machine here is an empty temp dir (TMPDIR: where MLX keeps the kernels it compiled); a
second run with the same one compiles nothing and says nothing of it."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.harness import CACHECD, TINY_REPO, Installed, short_tmp

PROMPT = "Experts stream from the hub into a verified cache, layer after layer. " * 3
COMPILING = "compiling kernels (once per machine)"
LAYER = re.compile(r"prefill layer (\d+)/(\d+): (\d+) experts read through the daemon .*?, "
                   r"(about \d+ s left|time left not known yet)$", re.M)


def run(socket: str, tmpdir: str) -> str:
    proc = subprocess.run(
        [*CACHECD, "run", "--model", TINY_REPO, "--socket", socket, "--prompt", PROMPT,
         "--max-tokens", "2", "--prefill-step-size", "32", "--no-chat", "--ram", "0"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": tmpdir})
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"),
                    reason="MLX compiles CPU kernels where the CPU is its device (Linux here)")
def test_the_first_run_says_it_compiles_once_and_guesses_no_time_before_a_read(
        installed_module: Installed) -> None:
    tmpdir = str(short_tmp("cdtmp"))
    first = run(str(installed_module.socket), tmpdir)
    assert first.count(COMPILING) == 1, first
    layers = LAYER.findall(first)
    assert [int(n) for n, _, _, _ in layers] == list(range(1, 7)), first  # the tiny model's 6
    # No time left before a layer has read an expert (layer 1 is dense: the kernels' compile)
    assert layers[0][2] == "0", first
    assert all(left == "time left not known yet" for _, _, read, left in layers if read == "0")
    assert layers[-1][3].startswith("about"), first  # layers that read give one
    again = run(str(installed_module.socket), tmpdir)
    assert COMPILING not in again, again
