"""The remote code a Kimi-style tiny model ships as ``tokenization_kimi.py`` (its source, as text).

It behaves as Kimi's own does where it matters to the ids and the loading: a
``TikTokenTokenizer(PreTrainedTokenizer)`` over ``tiktoken.model`` with the pre-tokenizer
pattern substituted for ``@PATTERN@`` and 256 special tokens after the ranks; ``encode(text)``
without keyword arguments runs tiktoken with every special token allowed, anything else goes
through transformers' own ``encode`` (which splits at added tokens and tokenizes the rest with
``_tokenize``); tokens are byte-level strings for transformers. And like Kimi's, it was written
for transformers 4: it imports ``bytes_to_unicode`` from the gpt2 tokenizer module.
"""

SOURCE = '''"""A tiny Kimi-style test model's tokenizer (`cachecd tiny-model --kimi-tokenizer`)."""

from pathlib import Path
from shutil import copyfile

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
from transformers.tokenization_utils import PreTrainedTokenizer

PATTERN = @PATTERN@
RESERVED = 256


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None,
                 pad_token=None, additional_special_tokens=None, added_tokens_decoder=None,
                 **kwargs):
        ranks = load_tiktoken_bpe(vocab_file)
        base = len(ranks)
        names = {int(i): t.content for i, t in (added_tokens_decoder or {}).items()}
        self.special = {names.get(i, f"<|reserved_token_{i}|>"): i
                        for i in range(base, base + RESERVED)}
        self.vocab_file = vocab_file
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=PATTERN,
                                       mergeable_ranks=ranks, special_tokens=self.special)
        chars = bytes_to_unicode()
        self.byte_of = {c: b for b, c in chars.items()}
        self.decoder = {i: "".join(chars[b] for b in self.model.decode_single_token_bytes(i))
                        for i in range(self.model.n_vocab)}
        self.encoder = {s: i for i, s in self.decoder.items()}
        self.unk_id = self.special[str(unk_token)]
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token,
                         pad_token=pad_token, additional_special_tokens=additional_special_tokens,
                         **kwargs)

    def encode(self, text, allow_special_tokens=True, **kwargs):
        if kwargs:
            return super().encode(text, **kwargs)
        if allow_special_tokens:
            return self.model.encode(text, allowed_special="all")
        return self.model.encode(text, disallowed_special=())

    def decode(self, token_ids, **kwargs):
        if kwargs:
            return super().decode(token_ids, **kwargs)
        return self.model.decode([token_ids] if isinstance(token_ids, int) else list(token_ids))

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[i] for i in self.encode(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.unk_id)

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        return bytes(self.byte_of[c] for c in "".join(tokens)).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        out = Path(save_directory) / ((filename_prefix + "-" if filename_prefix else "")
                                      + "tiktoken.model")
        if Path(self.vocab_file).resolve() != out.resolve():
            copyfile(self.vocab_file, out)
        return (str(out),)
'''
