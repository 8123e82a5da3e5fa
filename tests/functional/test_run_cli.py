"""`cachecd run` as people use mlx_lm.generate: --max-tokens (and --max-new), sampling with a
seed, the prompt from standard input, progress on stderr during a long prefill, and the chat
template applied by default as mlx_lm.generate applies it (--no-chat: the prompt as it is, what
mlx_lm's ``generate()`` function takes)."""

from __future__ import annotations

import array
import fcntl
import json
import os
import re
import subprocess
import sys
import termios
import time
from typing import Any

from tests.harness import CACHECD, TINY_REPO, Installed, run_cli

PROMPT = "Experts stream from the hub into a verified cache, layer after layer."


def run_json(inst: Installed, *args: str) -> dict[str, Any]:
    """``cachecd run --no-chat``: the prompt as mlx_lm's ``generate()`` takes it."""
    out = run_cli("run", "--model", TINY_REPO, "--socket", str(inst.socket), "--json", "--no-chat",
                  *args).stdout
    return json.loads(out)


def mlx_lm_generate_cli(model_dir: Any, *args: str) -> str:
    """The text ``python -m mlx_lm generate`` prints for the fully resident checkpoint."""
    proc = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", str(model_dir),
                           "--verbose", "False", *args], capture_output=True, text=True,
                          timeout=300, check=True)
    return proc.stdout.removesuffix("\n")


class MidText:
    """A child's stdout that lets its text begin but never end on its own: a one-page pipe
    filled but for ROOM bytes, so the child blocks writing once it wrote at most ROOM bytes
    (2000 tokens of the tiny model are 2000 bytes), whatever the load. Linux only (the pipe's
    size is set with F_SETPIPE_SZ); elsewhere the child's first byte is the cue, which a loaded
    machine can race."""

    ROOM = 64

    def __init__(self) -> None:
        self.read_end, self.write_end = os.pipe()
        self.filler = 0
        if hasattr(fcntl, "F_SETPIPE_SZ"):
            size = fcntl.fcntl(self.write_end, fcntl.F_SETPIPE_SZ, 4096)
            self.filler = os.write(self.write_end, b"." * (size - self.ROOM))

    def __enter__(self) -> MidText:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.read_end)
        if self.write_end >= 0:
            os.close(self.write_end)

    def wait_for_text(self, proc: subprocess.Popen[bytes]) -> None:
        """Until the child has written its first bytes of text (a state, not a time)."""
        if not self.filler:
            self.first = os.read(self.read_end, 1)
            return
        waiting = array.array("i", [0])
        while waiting[0] <= self.filler:
            assert proc.poll() is None, "cachecd run ended before its text began"
            fcntl.ioctl(self.read_end, termios.FIONREAD, waiting)
            time.sleep(0.02)

    def read_all(self) -> bytes:
        """The child's whole stdout (to its exit), without the filler."""
        os.close(self.write_end)  # else the read below never sees the end of the file
        self.write_end = -1
        chunks = [getattr(self, "first", b"")]
        while chunk := os.read(self.read_end, 65536):
            chunks.append(chunk)
        return b"".join(chunks)[self.filler:]


def test_chat_template_by_default_as_mlx_lm_generate(installed_module: Installed,
                                                     tiny_dir: Any) -> None:
    args = ["--prompt", PROMPT, "--max-tokens", "9"]
    chat = run_cli("run", "--model", TINY_REPO, "--socket", str(installed_module.socket),
                   *args).stdout
    assert chat.removesuffix("\n") == mlx_lm_generate_cli(tiny_dir, *args)
    plain = run_json(installed_module, *args)["text"]
    assert plain == mlx_lm_generate_cli(tiny_dir, *args, "--ignore-chat-template")
    assert plain != chat.removesuffix("\n")  # the template changed what the model saw


def test_max_tokens_and_its_alias(installed_module: Installed, tiny_resident: Any) -> None:
    from mlx_lm import generate

    got = run_json(installed_module, "--prompt", PROMPT, "--max-tokens", "7")
    assert len(got["tokens"]) == 7
    assert got["text"] == generate(*tiny_resident, PROMPT, max_tokens=7)  # greedy by default
    assert run_json(installed_module, "--prompt", PROMPT, "--max-new", "7")["tokens"] == got["tokens"]


def test_sampling_is_seeded(installed_module: Installed) -> None:
    """The same seed samples the same text, another seed other text (which text: mlx_lm.generate's,
    the next test)."""
    args = ["--prompt", PROMPT, "--max-tokens", "12", "--temp", "1.5", "--top-p", "0.95"]
    seven = run_json(installed_module, *args, "--seed", "7")
    assert run_json(installed_module, *args, "--seed", "7")["tokens"] == seven["tokens"]
    assert run_json(installed_module, *args, "--seed", "8")["tokens"] != seven["tokens"]


def test_sampled_text_is_mlx_lm_generates_for_the_same_flags(installed_module: Installed,
                                                              tiny_dir: Any) -> None:
    """--temp/--top-p/--seed: the text `python -m mlx_lm generate` prints for the same flags on
    the resident checkpoint (it seeds before it loads the model, so must we)."""
    for seed in ("42", "3"):
        args = ["--prompt", PROMPT, "--max-tokens", "12", "--temp", "0.8", "--top-p", "0.9",
                "--seed", seed]
        ours = run_cli("run", "--model", TINY_REPO, "--socket", str(installed_module.socket),
                       *args).stdout
        assert ours.removesuffix("\n") == mlx_lm_generate_cli(tiny_dir, *args), seed


def test_prompt_from_stdin_with_prefill_progress(installed_module: Installed,
                                                 tiny_resident: Any) -> None:
    from mlx_lm import generate

    long_prompt = PROMPT * 3  # about 210 tokens: 7 prefill steps of 32
    proc = subprocess.run(
        [*CACHECD, "run", "--model", TINY_REPO, "--socket", str(installed_module.socket), "--prompt",
         "-", "--max-tokens", "4", "--prefill-step-size", "32", "--json", "--no-chat"],
        input=long_prompt, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["text"] == generate(*tiny_resident, long_prompt, max_tokens=4)
    # The 7 steps run layer by layer: a line after each layer, then the tokens' total.
    layers = re.findall(r"prefill layer (\d+)/(\d+): (\d+) experts read through the daemon "
                        r"\(.+?\), (\d+) fetched from the Hub, [\d.]+ s, .+?/s, (?:about \d+ s left|time left not known yet)",
                        proc.stderr)
    assert [int(n[0]) for n in layers] == list(range(1, 7)), proc.stderr  # the tiny model's 6
    read = [int(n[2]) for n in layers]
    # Experts arrived layer by layer (layer 0 is dense), none twice: 5 MoE layers of 32.
    assert read == sorted(read) and read[1] > 0 and read[-1] <= 5 * 32
    steps = re.findall(r"prefill (\d+)/(\d+) tokens: (\d+) experts read", proc.stderr)
    assert len(steps) == 1 and steps[0][0] == steps[0][1], proc.stderr
    assert int(steps[0][2]) >= read[-1]


def test_the_text_ends_its_line_when_interrupted(installed_module: Installed) -> None:
    """Ctrl-C in the middle of the text: what was written ends with a newline, so the shell's
    prompt (or the error line) does not run on after it; the exit code says interrupted."""
    import signal

    # A suite started in the background by a script runs with SIGINT ignored, which a child
    # inherits, and Python then installs no KeyboardInterrupt: give the child Ctrl-C back.
    with MidText() as stdout:
        proc = subprocess.Popen([*CACHECD, "run", "--model", TINY_REPO, "--socket",
                                 str(installed_module.socket), "--prompt", PROMPT,
                                 "--max-tokens", "2000"], stdout=stdout.write_end,
                                stderr=subprocess.PIPE,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        stdout.wait_for_text(proc)
        proc.send_signal(signal.SIGINT)
        text = stdout.read_all().decode(errors="replace")
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err
    assert text and text.endswith("\n"), repr(text[-40:])
    done = run_cli("run", "--model", TINY_REPO, "--socket", str(installed_module.socket),
                   "--prompt", PROMPT, "--max-tokens", "3")
    assert done.stdout.endswith("\n") and done.stdout.strip(), repr(done.stdout)


def test_layer_by_layer_prefill_bitwise_mxfp4(installed_module: Installed, tiny_resident: Any) -> None:
    """The tiny K3 (mxfp4 experts) through `cachecd run`: prompts of 1, 2 and 5 prefill steps at
    two step sizes, run layer by layer; every token and its logprob bitwise mlx-lm's at the
    same step size (fp32, int4 and fp8: test_exactness_daemon_formats)."""
    from tests.exactness import (
        PREFILL_SIZES,
        PREFILL_STEPS,
        cachecd_run_logprobs,
        mlx_lm_logprobs,
        text_of,
    )

    model, tokenizer = tiny_resident
    for step in PREFILL_SIZES:
        for steps in PREFILL_STEPS:
            text = text_of(tokenizer, steps * step + 1)
            want = mlx_lm_logprobs(model, tokenizer, text, step, 4)
            got = cachecd_run_logprobs(installed_module.socket, TINY_REPO, text, step, 4)
            assert got == want, f"step {step} x {steps}"


def test_stats_lines_start_their_own_line_on_a_terminal(installed_module: Installed) -> None:
    """``--stats`` on a terminal (stdout and stderr one file): each token's line starts a line,
    never glued after the text."""
    import pty

    main, term = pty.openpty()
    proc = subprocess.Popen([*CACHECD, "run", "--model", TINY_REPO, "--socket",
                             str(installed_module.socket), "-p", PROMPT, "-m", "3", "--stats"],
                            stdout=term, stderr=term)
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
    os.close(main)
    assert proc.wait(timeout=300) == 0, seen.decode(errors="replace")
    shown = seen.decode(errors="replace").replace("\r\n", "\n")
    assert len(re.findall(r"token \d+: routed", shown)) == 3, shown
    assert len(re.findall(r"(?m)^token \d+: routed", shown)) == 3, shown
