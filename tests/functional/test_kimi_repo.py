"""A Kimi-style repository end to end, as a user meets a real one: `cachecd setup --stream`,
`run` (chat by default) and `warm --prompts` through a real daemon and a local hub.

The repo (``cachecd tiny-model --kimi-tokenizer --multimodal``) is a tiny K3 laid out as K3's
repo is: ``language_model.`` text weights beside a vision tower, a projector and an MTP layer, and
Kimi's tokenizer form: tiktoken.model, remote code written for transformers 4
(tokenization_kimi.py, which imports what transformers 5 dropped), tokenizer_config.json with
``auto_map`` and a chat template, no tokenizer.json.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.exactness import assert_bitwise, run_logits
from tests.harness import HubProcess, Installed, run_cli, short_tmp

REPO = "moonshot-like/tiny-kimi"
PROMPT = "Which experts does a Kimi chat route to?"


@dataclass
class Setup:
    full: Path
    inst: Installed
    first: str  # setup's output without --trust-remote-code
    second: str  # with it

    @property
    def code_sha(self) -> str:
        return hashlib.sha256((self.full / "tokenization_kimi.py").read_bytes()).hexdigest()

    def cli(self, *args: str, check: bool = True) -> Any:
        return run_cli(*args, "--model", REPO, "--socket", str(self.inst.socket), check=check)


@pytest.fixture(scope="module")
def kimi() -> Iterator[Setup]:
    root = short_tmp("cdk")
    run_cli("tiny-model", str(root / REPO), "--kimi-tokenizer", "--multimodal")
    hub = HubProcess(root)
    inst = Installed(short_tmp("cdki"))
    try:
        manifest = inst.base / "kimi.manifest"
        run_cli("manifest", "build", f"{REPO}@main", "--endpoint", hub.url, "--output",
                str(manifest))
        common = ["--stream", REPO, "--endpoint", hub.url, "--socket", str(inst.socket),
                  "--cache-dir", str(inst.base / "cache"), "--models-dir",
                  str(inst.base / "models"), "--manifest", str(manifest)]
        first = run_cli("setup", *common).stdout
        second = run_cli("setup", *common, "--trust-remote-code").stdout
        yield Setup(root / REPO, inst, first, second)
    finally:
        inst.cleanup()
        hub.stop()
        shutil.rmtree(root, ignore_errors=True)


def _resident_names(inst: Installed) -> set[str]:
    path = next((inst.base / "models").rglob("model-resident.safetensors"))
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return set(header) - {"__metadata__"}


def _reference(full: Path) -> tuple[Any, Any]:
    """mlx-lm on the full checkpoint; its tokenizer loaded as mlx-lm loads it, once the remote
    code can import (the same function put back where Kimi's code looks for it)."""
    from mlx_lm.utils import load_model, load_tokenizer

    from cachecd_engine.tokenizer import provide_transformers4_names

    provide_transformers4_names()
    model, config = load_model(full)
    return model, load_tokenizer(full, {"trust_remote_code": True},
                                 eos_token_ids=config.get("eos_token_id"))


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
    """What `python -m mlx_lm generate` feeds the model for ``text``."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def test_setup_names_the_remote_code_and_installs_the_text_model_only(kimi: Setup) -> None:
    # Without trust: installed (bytes are not code), and told which code would run, pinned.
    assert f"tokenization_kimi.py (sha256 {kimi.code_sha})" in kimi.first
    assert "--trust-remote-code" in kimi.first and "installed" in kimi.first
    assert "not installing 11 tensors" in kimi.first
    assert "vision_tower (7), mm_projector (2), language_model.model.layers.6 (2)" in kimi.first
    # With trust: the code ran once under the installed transformers; nothing fetched again.
    assert f"tokenizer: ran tokenization_kimi.py (sha256 {kimi.code_sha}): 640 ids" in kimi.second
    assert "chat template yes" in kimi.second and "fetched 0 B now" in kimi.second
    assert f"cachecd run --model {REPO} --trust-remote-code" in kimi.second
    names = _resident_names(kimi.inst)
    assert names and not any(n.startswith(("vision_tower", "mm_projector")) for n in names)
    assert not any(".layers.6." in n for n in names)


def test_run_and_warm_ask_for_trust_naming_the_pinned_file(kimi: Setup, tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT + "\n")
    for args in (("run", "--prompt", PROMPT), ("warm", "--prompts", str(prompts))):
        proc = kimi.cli(*args, check=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "remote_code_not_trusted" in proc.stderr and kimi.code_sha in proc.stderr
        assert "--trust-remote-code" in proc.stderr


def test_run_chats_as_mlx_lm_and_warm_routes_as_chatting(kimi: Setup, tmp_path: Path) -> None:
    from mlx_lm import generate

    reference, tokenizer = _reference(kimi.full)
    ids = _chat_ids(tokenizer, PROMPT)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_user|>")  # the template's own token
    text = kimi.cli("run", "--prompt", PROMPT, "--max-tokens", "10", "--trust-remote-code").stdout
    assert text.removesuffix("\n") == generate(reference, tokenizer, ids, max_tokens=10)

    prompts, trace = tmp_path / "p.txt", tmp_path / "w.jsonl"
    prompts.write_text(PROMPT + "\n")
    out = kimi.cli("warm", "--prompts", str(prompts), "--max-new", "2", "--trust-remote-code",
                   "--save-trace", str(trace), "--json").stdout
    assert json.loads(out.splitlines()[-1])["hit_rate_after"] == 1.0
    first = json.loads(trace.read_text().splitlines()[1])
    assert first["step"] == 0 and len(first["experts"]) + 1 == len(ids)  # the templated prompt


def test_python_load_with_trust_is_bitwise_mlx_lm(kimi: Setup) -> None:
    import cachecd_engine
    from cachecd import errors

    with pytest.raises(errors.RemoteCodeNotTrusted, match=kimi.code_sha):
        cachecd_engine.load(REPO, socket=kimi.inst.socket)
    reference, ref_tokenizer = _reference(kimi.full)
    model, tokenizer = cachecd_engine.load(REPO, socket=kimi.inst.socket, trust_remote_code=True)
    try:
        ids = _chat_ids(tokenizer, PROMPT)
        assert ids == _chat_ids(ref_tokenizer, PROMPT)
        ref, toks = run_logits(reference, ids, steps=4)
        assert_bitwise(ref, run_logits(model, ids, toks, steps=4)[0])
    finally:
        model.bank.close()
        model.bank.source.close()
