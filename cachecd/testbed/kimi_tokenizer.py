"""A Kimi-style tokenizer for the tiny models: tiktoken BPE ranks and remote code, as Kimi ships.

What a Kimi repository holds instead of a tokenizer.json, written small:
- ``tiktoken.model``: the BPE ranks, one ``base64(token bytes) rank`` a line: the 256 bytes
  (rank = byte value) and ``MERGES`` merges learned from a fixed text;
- ``tokenization_kimi.py``: remote code, a ``TikTokenTokenizer(PreTrainedTokenizer)`` that runs
  tiktoken with Kimi's pre-tokenizer pattern and 256 special tokens after the ranks (named ones
  from ``added_tokens_decoder``, the rest ``<|reserved_token_{id}|>``). Like Kimi's own, it was
  written for transformers 4: it imports ``bytes_to_unicode`` from transformers' gpt2 tokenizer
  module, which transformers 5 no longer has;
- ``tokenizer_config.json``: ``auto_map`` naming that class, the special tokens and a chat
  template in Kimi's ``<|im_user|>user<|im_middle|>...<|im_end|>`` form.

Invariants: no tokenizer.json; the files depend on nothing but this module (byte-identical each
time); ids ``BASE..VOCAB_SIZE-1`` are the special tokens, so a model's ``vocab_size`` is
``VOCAB_SIZE``.
"""

from __future__ import annotations

import base64
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from cachecd.testbed.kimi_remote_code import SOURCE

MERGES = 128
BASE = 256 + MERGES
RESERVED = 256
VOCAB_SIZE = BASE + RESERVED
# Kimi's pre-tokenizer: Han runs; words with their case and contractions; 1-3 digits; punctuation
# runs; newlines; other whitespace.
PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Special tokens at BASE + offset, where Kimi K2 puts them.
NAMED = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]",
}
BOS, EOS, EOS_CHAT = "[BOS]", "[EOS]", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
    "{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
REMOTE_CODE = "tokenization_kimi.py"
_CORPUS = (
    "Every routed expert streams from the hub into a verified cache, layer after layer. "
    "The model decides every token; no expert is skipped, pruned or approximated. "
    "It's the user's machine: they're warming the cache, and we'll fetch what's missing. "
    "Hello, world! def main():\n    return 42\n\n"
    "Kimi K3 has 896 routed experts in each of 92 layers, 16 routed per token.\n"
    "你好，世界。模型的每一个专家都从缓存中读取。 "
) * 4


def token_id(token: str) -> int:
    return BASE + next(i for i, name in NAMED.items() if name == token)


def ranks() -> dict[bytes, int]:
    """The 256 bytes, then ``MERGES`` byte-pair merges learned greedily from a fixed text."""
    table = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode("utf-8")]
             for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", _CORPUS)]
    while len(table) < BASE:
        pairs = Counter(p for w in words for p in zip(w, w[1:], strict=False))
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))  # ties: by bytes
        table[a + b] = len(table)
        words = [_merge(w, a, b) for w in words]
    return table


def _merge(word: list[bytes], a: bytes, b: bytes) -> list[bytes]:
    out: list[bytes] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def special_tokens() -> dict[str, int]:
    return {NAMED.get(i, f"<|reserved_token_{BASE + i}|>"): BASE + i for i in range(RESERVED)}


def tokenizer_config() -> dict[str, Any]:
    added = {
        str(BASE + i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
        for i, name in sorted(NAMED.items())
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": [n for i, n in sorted(NAMED.items()) if 2 <= i < 254],
        "auto_map": {"AutoTokenizer": [f"{REMOTE_CODE[:-3]}.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_CHAT,
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }


def write_tokenizer(out: Path, vocab_size: int = VOCAB_SIZE) -> list[Path]:
    """Write tiktoken.model, the remote code and tokenizer_config.json into ``out`` (and remove a
    byte-level tokenizer's files an earlier write left: mlx-lm would take tokenizer.json)."""
    if vocab_size != VOCAB_SIZE:
        raise ValueError(f"a Kimi-style tokenizer has {VOCAB_SIZE} ids, not {vocab_size}")
    for stale in ("tokenizer.json", "special_tokens_map.json"):
        (out / stale).unlink(missing_ok=True)
    model = "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks().items())
    files = {
        "tiktoken.model": model,
        REMOTE_CODE: SOURCE.replace("@PATTERN@", repr(PATTERN)),
        "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n",
    }
    paths = []
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
        paths.append(out / name)
    return paths
