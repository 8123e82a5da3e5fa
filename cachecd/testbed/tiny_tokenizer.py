"""A byte-level BPE tokenizer for the tiny model: every byte is a token, so any text round-trips.

Invariants:
- Ids 0..255 are the 256 bytes (in the usual printable-unicode stand-in alphabet), then the
  special tokens, then reserved tokens up to ``vocab_size``: every id the model can emit decodes.
- tokenizer_config.json names its class (PreTrainedTokenizerFast), so transformers never has to
  know the model type ``kimi_k3`` to load it.
- No merges are learned: the files depend only on ``vocab_size`` and are byte-identical each time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

BOS = "[BOS]"
EOS = "[EOS]"
# The token that ends a turn, and the tokenizer's eos: mlx-lm's tokenizer loader alone (without
# config.json's eos_token_id) then stops where generation_config.json says to.
EOS_CHAT = "<|im_end|>"
SPECIALS = (
    BOS,
    EOS,
    EOS_CHAT,
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "[PAD]",
    "[UNK]",
)
BYTE_TOKENS = 256

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
    "{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """The byte -> printable character table byte-level BPE uses, indexed by byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(BYTE_TOKENS):
        if b not in table:
            table[b] = chr(BYTE_TOKENS + extra)
            extra += 1
    return [table[b] for b in range(BYTE_TOKENS)]


def special_tokens(vocab_size: int) -> list[str]:
    reserved = vocab_size - BYTE_TOKENS - len(SPECIALS)
    return [*SPECIALS, *(f"<|reserved_token_{i}|>" for i in range(reserved))]


def token_id(token: str) -> int:
    return BYTE_TOKENS + SPECIALS.index(token)


def build_tokenizer(vocab_size: int) -> Tokenizer:
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special_tokens(vocab_size)]
    )
    return tok


def tokenizer_config(vocab_size: int) -> dict[str, Any]:
    added = {
        str(BYTE_TOKENS + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(special_tokens(vocab_size))
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS_CHAT,
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": added,
    }


def write_tokenizer(out: Path, vocab_size: int) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out`` (and
    remove a Kimi-style tokenizer's files an earlier write left)."""
    for stale in ("tiktoken.model", "tokenization_kimi.py"):
        (out / stale).unlink(missing_ok=True)
    files = {
        "tokenizer.json": build_tokenizer(vocab_size).to_str(pretty=True) + "\n",
        "tokenizer_config.json": _dumps(tokenizer_config(vocab_size)),
        "special_tokens_map.json": _dumps(
            {
                "bos_token": BOS,
                "eos_token": EOS_CHAT,
                "pad_token": "[PAD]",
                "unk_token": "[UNK]",
            }
        ),
    }
    paths = []
    for name, text in files.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
