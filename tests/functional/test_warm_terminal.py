"""`cachecd warm --prompts` on an ordinary 80-column terminal: its bar keeps its width while the
layer line beside it is long (tqdm would squeeze the bar to one character to fit the line; the
line is cut at the terminal's edge instead)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios
from pathlib import Path

from tests.harness import CACHECD, TINY_REPO, Installed

PROMPT = "Experts stream from the hub into a verified cache, layer after layer. " * 3


def test_warm_bar_keeps_its_width_beside_a_long_line(installed_module: Installed,
                                                     tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    main, term = pty.openpty()
    fcntl.ioctl(term, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen([*CACHECD, "warm", "--model", TINY_REPO, "--socket",
                             str(installed_module.socket), "--prompts", str(prompts),
                             "--max-new", "1", "--prefill-step-size", "32", "--no-chat"],
                            stdout=subprocess.PIPE, stderr=term, env=env)
    os.close(term)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the terminal's other end closed: the child is done
            break
        if not chunk:
            break
        seen += chunk
    proc.communicate(timeout=300)
    os.close(main)
    text = seen.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    drawn = [d for d in re.split(r"[\r\n]", text) if d.startswith("warm:")]
    beside = [d for d in drawn if "prompt 1: prefill" in d]
    assert beside, text[-3000:]  # the long line was drawn beside the bar
    for line in drawn:
        bar = re.match(r"warm: +\d+%\|(.*?)\|", line)
        assert bar and len(bar[1]) == 24, line
        assert len(line) <= 80, line
