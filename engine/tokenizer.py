"""The tokenizer of a streamed model: mlx-lm's loader, with a repo's own code run only when the
user trusts it and only as the manifest pins it.

Kimi repositories ship no tokenizer.json: ``tiktoken.model`` plus ``tokenization_kimi.py``, which
``tokenizer_config.json``'s ``auto_map`` names; transformers imports and runs that file. Loading
it, transformers first builds the config, and a Kimi or DeepSeek ``config.json`` names its own
``configuration_*.py`` in ``auto_map``: with trust, that file runs too.

Invariants:
- Remote code runs only with trust: ``trust_remote_code=True`` (``--trust-remote-code``), or
  ``tokenizer_config={"trust_remote_code": True}`` as mlx-lm takes it. A tokenizer that needs
  code stops without it, with a one-line error naming every code file and the sha256 the
  manifest pins for it.
- What runs is what the manifest pins: every module any ``*config.json``'s ``auto_map`` names
  (config, tokenizer, processor, ...) and the files each imports relatively must have the
  manifest's sha256 in the install dir, checked before transformers imports anything, and again
  in the copy transformers imports from its modules cache, right before that import
  (``remote_code``); code named in another repo (``org/name--module.Class``) is refused. With
  trust, the files are listed on stderr as they are about to run.
- Code written for transformers 4 that imports ``bytes_to_unicode`` from transformers' gpt2
  tokenizer module (Kimi's does) finds it there again: transformers 5 moved the function to
  ``convert_slow_tokenizer``, and the same function is put back where the code looks. Nothing
  else of the code is changed.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cachecd.errors import (
    ManifestInvalid,
    NotStreamable,
    RemoteCodeMismatch,
    RemoteCodeNotTrusted,
)
from cachecd_engine.remote_code import guard

TRUST_HINT = ("pass --trust-remote-code (cachecd run, warm, openai, setup --stream) or "
              "trust_remote_code=True (cachecd_engine.load)")


def remote_code_files(model_dir: Path) -> list[str]:
    """Every code file transformers could run for ``model_dir``: each module an ``auto_map`` of
    its ``*config.json`` files names (config.json's for AutoConfig and the models,
    tokenizer_config.json's for AutoTokenizer, a processor's, ...) and the files each imports
    relatively (transformers' own rule); none without such an entry."""
    files: set[str] = set()
    for ref in _auto_map_refs(model_dir):
        if "--" in ref:
            raise NotStreamable(
                f"{model_dir}'s config names code in another repo ({ref!r}); cachecd runs only "
                f"code its manifest pins")
        module = ref.rsplit(".", 1)[0].replace(".", "/") + ".py"
        files.add(module)
        if (model_dir / module).is_file():
            from transformers.dynamic_module_utils import get_relative_import_files

            files.update(str(Path(f).relative_to(model_dir))
                         for f in get_relative_import_files(str(model_dir / module)))
    return sorted(files)


def tokenizer_runs_code(model_dir: Path) -> bool:
    """Whether the tokenizer itself is remote code (tokenizer_config.json names AutoTokenizer)."""
    auto = _read_json(model_dir / "tokenizer_config.json").get("auto_map")
    return bool(auto.get("AutoTokenizer") if isinstance(auto, dict) else auto)


def _auto_map_refs(model_dir: Path) -> list[str]:
    refs: list[str] = []
    for path in sorted(model_dir.glob("*config.json")):
        auto = _read_json(path).get("auto_map")
        values = auto.values() if isinstance(auto, dict) else [auto] if auto else []
        for v in values:
            refs += [r for r in (v if isinstance(v, list | tuple) else [v]) if r]
    bad = [r for r in refs if not isinstance(r, str)]
    if bad:
        raise NotStreamable(f"{model_dir}: an auto_map names {bad[0]!r}, not a module.Class")
    return refs


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def describe(files: list[str], pins: Mapping[str, str]) -> str:
    """``tokenization_kimi.py (sha256 ...)``, for each file, as the manifest pins it."""
    return ", ".join(f"{f} (sha256 {pins.get(f, 'not pinned')})" for f in files)


def check_pinned(model_dir: Path, files: list[str], pins: Mapping[str, str]) -> None:
    for name in files:
        if not (model_dir / name).is_file():
            raise ManifestInvalid(f"{model_dir} has no {name}, which its config names; run "
                                  f"`cachecd setup --stream` again")
        digest = hashlib.sha256((model_dir / name).read_bytes()).hexdigest()
        if pins.get(name) != digest:
            raise RemoteCodeMismatch(
                f"{model_dir / name} has sha256 {digest}, not the {pins.get(name, 'no')} sha256 "
                f"the manifest pins: it was not installed by setup or has changed since, and "
                f"nothing of it ran; run `cachecd setup --stream` again")


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
    trusted = trust_remote_code or bool(extra.get("trust_remote_code"))
    if not trusted and tokenizer_runs_code(model_dir):
        raise RemoteCodeNotTrusted(
            f"{repo or model_dir}'s tokenizer runs code from its repo: "
            f"{describe(files, pinned)}, pinned by the manifest; if you trust it, {TRUST_HINT}")
    guard(model_dir, pinned)  # whatever else happens, nothing unpinned imports from it
    if not trusted:
        # Said outright: with None, transformers would ask on stdin whether to run it.
        return {**extra, "trust_remote_code": False}
    check_pinned(model_dir, files, pinned)
    provide_transformers4_names()
    print(f"remote code of {repo or model_dir}, trusted, each file checked against the sha256 "
          f"the manifest pins before it is imported: {describe(files, pinned)}", file=sys.stderr)
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
