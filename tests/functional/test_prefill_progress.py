"""Prefill progress in layer order where a user watches one: `cachecd openai`'s log (a line for
the first and the last layer of a pass) with its keepalive comments coming once a layer while a
streamed request prefills, and `cachecd warm --prompts`' bar on a terminal (`cachecd run`'s
lines: tests/functional/test_run_cli.py)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import termios
import urllib.request
from typing import Any

from tests.harness import CACHECD, TINY_REPO, Installed, OpenAIServer

PROMPT = "Experts stream from the hub into a verified cache, layer after layer. " * 3
STEP = 32  # about 210 tokens: 7 steps, the first 6 held back and run layer by layer
LAYERS = 6  # the tiny model's


def test_openai_keeps_alive_and_logs_layers_during_a_layer_by_layer_prefill(
        installed_module: Installed) -> None:
    srv = OpenAIServer(TINY_REPO, installed_module.socket, "--prefill-step-size", str(STEP),
                       "--ram", "0")
    try:
        # A seed sends the request down mlx-lm's one-request path (stream_generate), which
        # prefills layer by layer; the stream is read raw, as the openai client hides comments.
        body = json.dumps({"model": TINY_REPO, "prompt": PROMPT, "max_tokens": 2,
                           "temperature": 0, "seed": 0, "stream": True}).encode()
        request = urllib.request.Request(f"{srv.url}/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as answer:
            lines = [raw.decode().strip() for raw in answer]
        log = srv.log()
    finally:
        assert srv.stop() == 0, srv.log()
    events = [ln for ln in lines if ln.startswith((": keepalive", "data:"))]
    first_data = next(i for i, ln in enumerate(events) if ln.startswith("data:"))
    alive = [tuple(map(int, re.findall(r"\d+", ln))) for ln in events[:first_data]]
    assert all(ln.startswith(": keepalive") for ln in events[:first_data])
    # Before any text: the start, then once a layer during the pass, rising steadily (a held
    # step has done no work: it reports nothing).
    done = [d for d, _ in alive]
    assert len(alive) >= 1 + LAYERS and done == sorted(done) and done[0] == 0, alive
    assert len(set(done)) >= LAYERS and max(done.count(d) for d in done) <= 2, alive
    layer_lines = re.findall(r"prefill layer (\d+)/(\d+): (\d+) experts read through the daemon "
                             r"\(.+?\), \d+ fetched from the Hub, [\d.]+ s, .+?/s, (?:about \d+ s left|time left not "
                             r"known yet)", log)
    layers_done = [int(n[0]) for n in layer_lines]
    assert layers_done[0] == 1 and layers_done[-1] == LAYERS and int(layer_lines[-1][1]) == LAYERS, log[-3000:]
    assert int(layer_lines[-1][2]) > 0  # --ram 0: every routed expert read through the daemon


def test_warm_prompts_shows_the_layers_beside_its_bar_on_a_terminal(
        installed_module: Installed, tmp_path: Any) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    args = [*CACHECD, "warm", "--model", TINY_REPO, "--socket", str(installed_module.socket),
            "--prompts", str(prompts), "--max-new", "1", "--prefill-step-size", str(STEP),
            "--no-chat"]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    main, term = pty.openpty()  # stderr on a terminal: the bar is drawn
    # A terminal wide enough for the line (a new pty is 0 columns: tqdm would draw nothing).
    fcntl.ioctl(term, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 400, 0, 0))
    try:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=term, env=env)
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
        out, _ = proc.communicate(timeout=300)
    finally:
        os.close(main)
    text = seen.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    shown = [int(n) for n in re.findall(rf"prompt 1: prefill layer (\d+)/{LAYERS}: \d+ experts "
                                        r"read", text)]
    assert shown and shown[-1] == LAYERS, text[-3000:]
    # Off a terminal the bar, and the layers with it, are not drawn.
    piped = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert piped.returncode == 0 and "prefill layer" not in piped.stderr, piped.stderr
