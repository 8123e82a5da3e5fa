"""The tokenizer of a streamed model: mlx-lm's loader, with a repo's own code run only when the
user trusts it and only as the manifest pins it.

Kimi repositories ship no tokenizer.json: ``tiktoken.model`` plus ``tokenization_kimi.py``, which
``tokenizer_config.json``'s ``auto_map`` names; transformers imports and runs that file.

Invariants:
- Remote code runs only with trust: ``trust_remote_code=True`` (``--trust-remote-code``), or
  ``tokenizer_config={"trust_remote_code": True}`` as mlx-lm takes it. Without it the load stops
  with a one-line error naming every code file and the sha256 the manifest pins for it.
- What runs is what the manifest pins: the module ``auto_map`` names and the files it imports
  relatively must have the manifest's sha256, checked before transformers imports anything;
  code named in another repo (``org/name--module.Class``) is refused.
- Code written for transformers 4 that imports ``bytes_to_unicode`` from transformers' gpt2
  tokenizer module (Kimi's does) finds it there again: transformers 5 moved the function to
  ``convert_slow_tokenizer``, and the same function is put back where the code looks. Nothing
  else of the code is changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cachecd.errors import ManifestInvalid, NotStreamable, RemoteCodeNotTrusted

TRUST_HINT = ("pass --trust-remote-code (cachecd run, warm, openai, setup --stream) or "
              "trust_remote_code=True (cachecd_engine.load)")


def remote_code_files(model_dir: Path) -> list[str]:
    """The code files transformers would run to build the tokenizer: the module
    ``tokenizer_config.json``'s ``auto_map`` names for ``AutoTokenizer`` and the files it imports
    relatively (transformers' own rule); none without such an entry."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    auto = config.get("auto_map") if isinstance(config, dict) else None
    entry = auto.get("AutoTokenizer") if isinstance(auto, dict) else auto
    refs = [r for r in (entry if isinstance(entry, list | tuple) else [entry]) if r]
    files: set[str] = set()
    for ref in refs:
        if not isinstance(ref, str) or "--" in ref:
            raise NotStreamable(
                f"{model_dir}'s tokenizer names code in another repo ({ref!r}); cachecd runs only "
                f"code its manifest pins")
        module = ref.rsplit(".", 1)[0].replace(".", "/") + ".py"
        files.add(module)
        if (model_dir / module).is_file():
            from transformers.dynamic_module_utils import get_relative_import_files

            files.update(str(Path(f).relative_to(model_dir))
                         for f in get_relative_import_files(str(model_dir / module)))
    return sorted(files)


def describe(files: list[str], pins: Mapping[str, str]) -> str:
    """``tokenization_kimi.py (sha256 ...)``, for each file, as the manifest pins it."""
    return ", ".join(f"{f} (sha256 {pins.get(f, 'not pinned')})" for f in files)


def check_pinned(model_dir: Path, files: list[str], pins: Mapping[str, str]) -> None:
    for name in files:
        if not (model_dir / name).is_file():
            raise ManifestInvalid(f"{model_dir} has no {name}, which its tokenizer names; run "
                                  f"`cachecd setup --stream` again")
        digest = hashlib.sha256((model_dir / name).read_bytes()).hexdigest()
        if pins.get(name) != digest:
            raise ManifestInvalid(
                f"{model_dir / name} has sha256 {digest}, not the {pins.get(name, 'no')} sha256 "
                f"the manifest pins: it was not installed by setup or has changed since; run "
                f"`cachecd setup --stream` again")


def provide_transformers4_names() -> None:
    """Put ``bytes_to_unicode`` back in transformers' gpt2 tokenizer module if it is missing."""
    import transformers.models.gpt2.tokenization_gpt2 as gpt2

    if not hasattr(gpt2, "bytes_to_unicode"):
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        setattr(gpt2, "bytes_to_unicode", bytes_to_unicode)  # noqa: B010 - typed without it


def tokenizer_options(model_dir: Path, tokenizer_config: dict[str, Any] | None, *,
                      trust_remote_code: bool, pins: Mapping[str, str] | None,
                      repo: str | None = None) -> dict[str, Any] | None:
    """The ``tokenizer_config`` to hand mlx-lm's ``load_tokenizer`` for ``model_dir``, once the
    rules of the module docstring are met (raises otherwise). ``pins`` maps file names to the
    sha256 the manifest pins (None: no manifest, so no remote code may run)."""
    extra = dict(tokenizer_config or {})
    files = remote_code_files(model_dir)
    if not files:
        return tokenizer_config
    pinned = dict(pins or {})
    if not (trust_remote_code or extra.get("trust_remote_code")):
        raise RemoteCodeNotTrusted(
            f"{repo or model_dir}'s tokenizer runs code from its repo: "
            f"{describe(files, pinned)}, pinned by the manifest; if you trust it, {TRUST_HINT}")
    check_pinned(model_dir, files, pinned)
    provide_transformers4_names()
    extra["trust_remote_code"] = True
    return extra


def load_tokenizer(model_dir: Path, tokenizer_config: dict[str, Any] | None,
                   eos_token_ids: Any = None, *, trust_remote_code: bool = False,
                   pins: Mapping[str, str] | None = None, repo: str | None = None) -> Any:
    """mlx-lm's ``load_tokenizer`` for ``model_dir``, under the rules of the module docstring."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    extra = tokenizer_options(model_dir, tokenizer_config, trust_remote_code=trust_remote_code,
                              pins=pins, repo=repo)
    return mlx_load_tokenizer(model_dir, extra, eos_token_ids=eos_token_ids)
