"""A Kimi-style tokenizer (tiktoken ranks + remote code, no tokenizer.json) through the engine's
loader: ids exactly tiktoken's with Kimi's pattern, remote code only when trusted and pinned."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tiktoken

from cachecd import errors
from cachecd.testbed import kimi_tokenizer, tiny_tokenizer
from cachecd_engine.tokenizer import (
    load_tokenizer,
    provide_transformers4_names,
    remote_code_files,
)

# Kimi's pre-tokenizer pattern, as tokenization_kimi.py in moonshotai's Kimi repos spells it.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
TEXTS = [
    "Hello, world!",
    "It's the model's turn; they're done, we'll see, I'd say YOU'RE right.",
    "你好，世界。模型的每一个专家都从缓存中读取。Mixed 中文 and English",
    "numbers 1234567 and 3.14159, 2026-12-03",
    "def main():\n    return 42\n\n\n  trailing   spaces  \t tab\r\nCRLF",
    "emoji 🙂👍🏽 and accents: naïve café Ünïcödé",
    "specials <|im_end|> inline, [BOS] and <|im_user|>user<|im_middle|>hi<|im_end|>",
    "a reserved one <|reserved_token_500|> and a fake <|not_a_token|>",
    "CamelCaseIdentifier snake_case_name HTTPServerError",
    "",
    " ",
]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kimi")
    kimi_tokenizer.write_tokenizer(out)
    (out / "config.json").write_text('{"model_type": "kimi_k2"}')
    return out


def pins(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir()}


def reference(d: Path) -> tiktoken.Encoding:
    """tiktoken itself over the ranks file, with Kimi's pattern and 256 specials after it."""
    ranks = {}
    for line in (d / "tiktoken.model").read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding("kimi-reference", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                             special_tokens=kimi_tokenizer.special_tokens())


@pytest.fixture(scope="module")
def loaded(kimi_dir: Path) -> Any:
    return load_tokenizer(kimi_dir, None, trust_remote_code=True, pins=pins(kimi_dir))


def test_files_are_kimis_form(kimi_dir: Path) -> None:
    assert kimi_tokenizer.PATTERN == KIMI_PATTERN
    assert not (kimi_dir / "tokenizer.json").exists()
    lines = (kimi_dir / "tiktoken.model").read_text().splitlines()
    assert len(lines) == kimi_tokenizer.BASE
    assert lines[65] == f"{base64.b64encode(b'A').decode()} 65"  # the bytes first, rank = value
    code = (kimi_dir / "tokenization_kimi.py").read_text()
    assert "from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode" in code
    assert "class TikTokenTokenizer(PreTrainedTokenizer)" in code


def test_ids_are_tiktokens_with_kimis_pattern(kimi_dir: Path, loaded: Any) -> None:
    """Every path mlx-lm encodes by: encode(text), with and without special tokens added."""
    ref = reference(kimi_dir)
    assert type(loaded._tokenizer).__name__ == "TikTokenTokenizer"
    assert loaded.vocab_size == kimi_tokenizer.VOCAB_SIZE
    for text in TEXTS:
        want = ref.encode(text, allowed_special="all")
        assert loaded.encode(text) == want, text
        assert loaded.encode(text, add_special_tokens=False) == want, text
        assert loaded.encode(text, add_special_tokens=True) == want, text  # Kimi adds no BOS
        assert loaded.decode(want) == text
    assert loaded.encode("<|im_end|>") == [kimi_tokenizer.token_id("<|im_end|>")]
    assert loaded.encode("<|reserved_token_500|>") == [500]


def test_chat_template_and_streaming_detokenizer(kimi_dir: Path, loaded: Any) -> None:
    assert loaded.has_chat_template
    messages = [{"role": "user", "content": "It's 你好 time"}]
    text = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_user|>user<|im_middle|>It's 你好 time<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|>")
    ids = loaded.encode(text, add_special_tokens=False)
    assert ids == reference(kimi_dir).encode(text, allowed_special="all")
    assert loaded.apply_chat_template(messages, add_generation_prompt=True) == ids
    detok = loaded.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == text
    assert kimi_tokenizer.token_id("<|im_end|>") in loaded.eos_token_ids


def test_remote_code_needs_trust_and_its_pin(kimi_dir: Path, tmp_path: Path) -> None:
    good = pins(kimi_dir)
    with pytest.raises(errors.RemoteCodeNotTrusted) as err:
        load_tokenizer(kimi_dir, None, trust_remote_code=False, pins=good, repo="org/kimi")
    msg = err.value.message
    assert "org/kimi" in msg and "tokenization_kimi.py" in msg and "--trust-remote-code" in msg
    assert good["tokenization_kimi.py"] in msg  # the pinned sha256, in full
    # mlx-lm's own way of saying it also counts.
    assert load_tokenizer(kimi_dir, {"trust_remote_code": True}, pins=good) is not None
    with pytest.raises(errors.ManifestInvalid, match="tokenization_kimi.py"):
        load_tokenizer(kimi_dir, None, trust_remote_code=True, pins={})
    changed = dict(good, **{"tokenization_kimi.py": "0" * 64})
    with pytest.raises(errors.ManifestInvalid, match="setup --stream"):
        load_tokenizer(kimi_dir, None, trust_remote_code=True, pins=changed)


def test_the_remote_code_fails_on_transformers_5_without_the_shim(kimi_dir: Path) -> None:
    """As Kimi's own code does: the import the engine provides is what is missing."""
    import transformers.models.gpt2.tokenization_gpt2 as gpt2

    if "bytes_to_unicode" in vars(gpt2) and gpt2.bytes_to_unicode.__module__ == gpt2.__name__:
        pytest.skip("this transformers still has bytes_to_unicode in its gpt2 tokenizer module")
    code = ("from transformers import AutoTokenizer\n"
            f"AutoTokenizer.from_pretrained({str(kimi_dir)!r}, trust_remote_code=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "bytes_to_unicode" in proc.stderr, proc.stderr[-800:]


def test_the_shim_is_gpt2s_byte_table() -> None:
    provide_transformers4_names()
    from transformers.models.gpt2 import tokenization_gpt2

    table = tokenization_gpt2.bytes_to_unicode()  # type: ignore[attr-defined]
    assert [table[b] for b in range(256)] == tiny_tokenizer._byte_alphabet()


def test_the_code_that_runs_is_the_named_module_and_its_relative_imports(
        kimi_dir: Path, tmp_path: Path) -> None:
    """K3's tokenization_kimi.py imports encoding_k3.py beside it: both are pinned. A modeling
    file the tokenizer does not import is not named; code in another repo is refused."""
    import json
    import shutil

    d = tmp_path / "k3ish"
    shutil.copytree(kimi_dir, d)
    code = (d / "tokenization_kimi.py").read_text()
    (d / "tokenization_kimi.py").write_text("from .encoding_k3 import SEGMENTS\n" + code)
    (d / "encoding_k3.py").write_text("SEGMENTS = ()\n")
    (d / "modeling_kimi.py").write_text("raise RuntimeError('never imported')\n")
    assert remote_code_files(d) == ["encoding_k3.py", "tokenization_kimi.py"]
    good = pins(d)
    with pytest.raises(errors.RemoteCodeNotTrusted, match="encoding_k3.py"):
        load_tokenizer(d, None, pins=good)
    with pytest.raises(errors.ManifestInvalid, match="encoding_k3.py"):
        load_tokenizer(d, None, trust_remote_code=True, pins=dict(good, **{"encoding_k3.py": "0"}))
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["auto_map"]["AutoTokenizer"] = ["other/repo--tokenization_kimi.TikTokenTokenizer", None]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(errors.NotStreamable, match="another repo"):
        load_tokenizer(d, None, trust_remote_code=True, pins=good)
    assert remote_code_files(tmp_path) == []  # no tokenizer_config.json: nothing to run


@pytest.mark.parametrize("hash_level", [True, False])
def test_the_modules_cache_copy_is_checked_where_it_is_imported(tmp_path: Path,
                                                                hash_level: bool) -> None:
    """``remote_code.check_import`` on a modules cache laid out as transformers lays out a local
    model's code (``transformers_modules/<folder>/<hash>/``), or without the hash level: the
    module and what it imports relatively must have their pins; other folders pass."""
    import uuid

    from cachecd_engine.remote_code import check_import, guard, module_dir_name

    model = tmp_path / f"m{uuid.uuid4().hex}"
    model.mkdir()
    code = {"configuration_x.py": "from .helpers_x import Y\n", "helpers_x.py": "Y = 1\n"}
    for name, text in code.items():
        (model / name).write_text(text)
    guard(model, pins(model))
    folder = tmp_path / "mods" / "transformers_modules" / module_dir_name(model)
    copy = folder / "0123abcd" if hash_level else folder
    copy.mkdir(parents=True)
    for name, text in code.items():
        (copy / name).write_text(text)
    module = (copy / "configuration_x.py").relative_to(tmp_path / "mods")
    check_import(tmp_path / "mods", module)
    (copy / "helpers_x.py").write_text("Y = 2\n")  # imported relatively: checked too
    with pytest.raises(errors.RemoteCodeMismatch, match="helpers_x.py.*nothing of it ran"):
        check_import(tmp_path / "mods", module)
    other = tmp_path / "mods" / "transformers_modules" / "someone_else" / "h" / "x.py"
    other.parent.mkdir(parents=True)
    other.write_text("anything\n")
    check_import(tmp_path / "mods", other.relative_to(tmp_path / "mods"))
