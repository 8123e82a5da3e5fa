"""`cachecd run` takes what an mlx_lm.generate user types, with the same meanings: for each group of
flags, the text `cachecd run` prints through a real daemon is the text mlx_lm.generate itself
(its ``main()``) prints for the resident checkpoint with the same flags; and each flag that can
change the text on this model does (mlx-lm's text without it differs), so the comparison proves
that flag's meaning rather than passing with the flag ignored."""

from __future__ import annotations

import contextlib
import importlib
import io
import shutil
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from tests.harness import TINY_REPO, Installed, run_cli
from tests.lora import write_adapter

PROMPT = "Experts stream from the hub into a verified cache, layer after layer."
# A chat template of the user's (--chat-template-config hands apply_chat_template keywords): it
# shows every message, so --system-prompt and --prefill-response change what the model reads.
TEMPLATE = ('{"chat_template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\\n'
            '{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"}')


def mlx_lm_generate(tiny_dir: Path, *args: str) -> str:
    """What ``mlx_lm.generate --verbose False`` prints for the resident checkpoint (its main(),
    run in this process: the tiny model loads in a moment)."""
    module = importlib.import_module("mlx_lm.generate")
    out = io.StringIO()
    argv = ["mlx_lm.generate", "--model", str(tiny_dir), "--verbose", "False", *args]
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(out):
        module.main()
    return out.getvalue()


def cachecd_run(inst: Installed, *args: str) -> str:
    return run_cli("run", "--model", TINY_REPO, "--socket", str(inst.socket), *args).stdout


def without(args: list[str], flag: str) -> list[str]:
    """``args`` with ``flag`` and its values (up to the next flag) left out."""
    i = args.index(flag)
    j = i + 1
    while j < len(args) and not args[j].startswith("-"):
        j += 1
    return args[:i] + args[j:]


def check_group(inst: Installed, tiny_dir: Path, args: list[str], matters: list[str]) -> str:
    want = mlx_lm_generate(tiny_dir, *args)
    for flag in matters:
        assert mlx_lm_generate(tiny_dir, *without(args, flag)) != want, f"{flag} changes nothing"
    assert cachecd_run(inst, *args) == want, args
    return want


def test_chat_flags(installed_module: Installed, tiny_dir: Path) -> None:
    """-p, -m, --system-prompt, --chat-template-config (its keywords reach the template)."""
    args = ["-p", PROMPT, "-m", "9", "--system-prompt", "Answer in French.",
            "--chat-template-config", TEMPLATE]
    check_group(installed_module, tiny_dir, args, ["--system-prompt", "--chat-template-config"])


def test_prefill_response_and_extra_eos(installed_module: Installed, tiny_dir: Path) -> None:
    args = ["-p", PROMPT, "-m", "12", "--prefill-response", "Sure, the cache"]
    text = mlx_lm_generate(tiny_dir, *args)
    # An eos token the text meets after its third character: the text ends there.
    stop = next(c for c in text[3:] if c.isalnum())
    args += ["--extra-eos-token", stop]
    got = check_group(installed_module, tiny_dir, args, ["--prefill-response", "--extra-eos-token"])
    assert len(got) < len(text)


def test_sampling_flags(installed_module: Installed, tiny_dir: Path) -> None:
    """XTC, min-p with its floor, top-k: mlx_lm.generate's sampler, built by its own main()."""
    args = ["-p", PROMPT, "-m", "12", "--temp", "1.0", "--seed", "1", "--top-k", "3",
            "--xtc-probability", "1.0", "--xtc-threshold", "0.05", "--min-p", "0.1",
            "--min-tokens-to-keep", "5"]
    check_group(installed_module, tiny_dir, args,
                ["--top-k", "--xtc-probability", "--xtc-threshold", "--min-p",
                 "--min-tokens-to-keep"])


def test_verbose_false_prints_only_the_answer(installed_module: Installed, tiny_dir: Path) -> None:
    """--verbose F: stdout is mlx_lm.generate's byte for byte, and nothing else is said. Flags
    accepted with the meaning they have in mlx-lm for this model, where it is none: --max-kv-size
    (K3 makes its own cache), --quantize-activations (no nvfp4/mxfp8 layer),
    --use-default-chat-template (read by nothing in mlx_lm.generate)."""
    args = ["-p", PROMPT, "-m", "9", "--ignore-chat-template", "--max-kv-size", "8",
            "-qa", "--use-default-chat-template", "--prefill-step-size", "16"]
    want = mlx_lm_generate(tiny_dir, *args)
    assert mlx_lm_generate(tiny_dir, *without(args, "--ignore-chat-template")) != want
    proc = run_cli("run", "--model", TINY_REPO, "--socket", str(installed_module.socket), *args,
                   "--verbose", "F")
    assert proc.stdout == want
    assert proc.stderr == ""
    assert cachecd_run(installed_module, *args, "--no-chat") == want  # the old name stays


def test_adapter_path(installed_module: Installed, tiny_dir: Path) -> None:
    adapter = write_adapter(tiny_dir, ["self_attn.o_proj"])
    try:
        args = ["-p", PROMPT, "-m", "9", "--adapter-path", str(adapter)]
        check_group(installed_module, tiny_dir, args, ["--adapter-path"])
    finally:
        shutil.rmtree(adapter, ignore_errors=True)


@pytest.mark.parametrize("flag", ["--draft-model", "--kv-bits", "--prompt-cache-file", "--image"])
def test_what_cannot_apply_is_refused_saying_why(flag: str, tmp_path: Any) -> None:
    proc = run_cli("run", "--socket", str(tmp_path / "none.sock"), "-p", "x", flag, "v",
                   check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("usage: cachecd run "), proc.stderr
    assert f"{flag} is mlx_lm.generate's, but not cachecd run's: " in proc.stderr
