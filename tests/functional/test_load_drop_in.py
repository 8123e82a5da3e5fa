"""Code written for mlx_lm runs unchanged on ``cachecd_engine.load`` (only the import changes), its
greedy text is mlx-lm's on the fully resident checkpoint, and what cannot apply to streamed
experts is refused with a one-line error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cachecd.errors import NotStreamable, RepoNotAllowed
from tests.harness import TINY_REPO, Installed
from tests.lora import write_adapter

PROMPT = "Experts stream from the hub into a verified cache, layer after layer."
N = 20


def greedy(model: Any, tokenizer: Any, prompt: str = PROMPT) -> str:
    from mlx_lm import generate

    return generate(model, tokenizer, prompt, max_tokens=N)


def test_mlx_lm_code_runs_unchanged(installed_module: Installed, tiny_resident: Any) -> None:
    from mlx_lm import generate, stream_generate

    from cachecd_engine import load

    want = greedy(*tiny_resident)
    model, tokenizer = load(TINY_REPO, socket=installed_module.socket)
    assert generate(model, tokenizer, PROMPT, max_tokens=N) == want
    assert "".join(r.text for r in stream_generate(model, tokenizer, PROMPT, max_tokens=N)) == want
    model.bank.source.close()


def test_config_arguments_as_mlx_lm_load(installed_module: Installed, tiny_dir: Path) -> None:
    import mlx_lm

    from cachecd_engine import load

    # model_config reaches the config (and the tokenizer's eos ids), tokenizer_config the tokenizer
    kw = {"model_config": {"eos_token_id": [258, 33]},
          "tokenizer_config": {"chat_template": "{{ messages[0]['content'] }}"}}
    ref, ref_tok, ref_config = mlx_lm.load(str(tiny_dir), return_config=True, **kw)
    model, tokenizer, config = load(TINY_REPO, return_config=True, lazy=True,
                                    socket=installed_module.socket, **kw)
    assert config == ref_config and config["eos_token_id"] == [258, 33]
    assert tokenizer.eos_token_ids == ref_tok.eos_token_ids == {258, 33}
    assert tokenizer.chat_template == ref_tok.chat_template == kw["tokenizer_config"]["chat_template"]
    assert greedy(model, tokenizer) == greedy(ref, ref_tok)
    model.bank.source.close()


def test_revision_must_be_the_pinned_commit(installed_module: Installed, tiny_manifest: Any) -> None:
    from cachecd_engine import load

    socket = installed_module.socket
    model, _ = load(TINY_REPO, revision=tiny_manifest.revision[:12], socket=socket)
    model.bank.source.close()
    with pytest.raises(NotStreamable, match=f"cachecd setup --stream {TINY_REPO}@v2"):
        load(TINY_REPO, revision="v2", socket=socket)


def test_what_is_not_streamed_is_refused(installed_module: Installed, tiny_dir: Path) -> None:
    from cachecd_engine import load

    socket = installed_module.socket
    with pytest.raises(NotStreamable, match="local folder.*mlx_lm.load"):
        load(str(tiny_dir), socket=socket)
    with pytest.raises(RepoNotAllowed, match="cachecd setup --stream nobody/nothing"):
        load("nobody/nothing", socket=socket)


def test_a_model_file_is_refused_with_or_without_trust(installed_module: Installed) -> None:
    """mlx-lm's trust_remote_code runs the config's model_file; cachecd's never does, and says
    why, whichever way it is asked (the config, or model_config as mlx_lm.load takes it)."""
    from cachecd_engine import load

    local = next((installed_module.base / "models" / TINY_REPO).iterdir())
    marker = local / "custom-ran"
    code = local / "custom_model.py"
    code.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    try:
        for trust in (False, True):
            with pytest.raises(NotStreamable) as info:
                load(TINY_REPO, model_config={"model_file": "custom_model.py"},
                     trust_remote_code=trust, socket=installed_module.socket)
            message = info.value.message
            assert "'custom_model.py'" in message and "mlx_lm.load would import and run" in message
            assert ("not that file" in message) is trust and "\n" not in message
        assert not marker.exists()
    finally:
        code.unlink()


def test_adapters(installed_module: Installed, tiny_dir: Path, tiny_resident: Any) -> None:
    import shutil

    import mlx_lm

    from cachecd_engine import load

    socket = installed_module.socket
    resident_only = write_adapter(tiny_dir, ["self_attn.o_proj", "mlp.shared_experts.down_proj"])
    on_experts = write_adapter(tiny_dir, ["mlp.switch_mlp.gate_proj"])
    try:
        want = greedy(*mlx_lm.load(str(tiny_dir), adapter_path=str(resident_only)))
        assert want != greedy(*tiny_resident)  # the adapter does change the text
        model, tokenizer = load(TINY_REPO, adapter_path=str(resident_only), socket=socket)
        assert greedy(model, tokenizer) == want
        model.bank.source.close()
        with pytest.raises(NotStreamable, match="changes routed-expert weights"):
            load(TINY_REPO, adapter_path=str(on_experts), socket=socket)
    finally:
        shutil.rmtree(resident_only, ignore_errors=True)
        shutil.rmtree(on_experts, ignore_errors=True)


def test_long_prompt_prefills_layer_by_layer(installed_module: Installed, tiny_resident: Any) -> None:
    """``mlx_lm.generate`` / ``stream_generate`` with a prompt of several prefill steps: the
    steps run layer by layer (one pass), and every token and logprob is mlx-lm's at that step."""
    from mlx_lm import generate, stream_generate

    from cachecd_engine import load

    prompt, step = PROMPT * 3, 32  # about 210 tokens: 6 steps and the last token's
    model, tokenizer = load(TINY_REPO, socket=installed_module.socket)
    want = [(r.token, r.logprobs[r.token].item()) for r in stream_generate(
        *tiny_resident, prompt, max_tokens=N, prefill_step_size=step)]
    got = [(r.token, r.logprobs[r.token].item()) for r in stream_generate(
        model, tokenizer, prompt, max_tokens=N, prefill_step_size=step)]
    assert got == want and model.deferral.passes == 1 and model.deferral.held_steps >= 6
    assert generate(model, tokenizer, prompt, max_tokens=N, prefill_step_size=step) == \
        generate(*tiny_resident, prompt, max_tokens=N, prefill_step_size=step)
    assert model.deferral.passes == 2
    model.bank.source.close()
