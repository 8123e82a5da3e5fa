"""Shared checks for bit-identity: logits over a prefill plus greedy decode steps, compared bitwise."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from cachecd.setup.resident import ResidentWriter

DECODE_STEPS = 20


def run_logits(model: Any, tokens: list[int], forced: list[int] | None = None,
               steps: int = DECODE_STEPS) -> tuple[list[np.ndarray], list[int]]:
    """Logits of the prefill and of ``steps`` greedy decode steps (or the ``forced`` tokens)."""
    cache = make_prompt_cache(model)  # the model's own make_cache when it has one
    logits = model(mx.array(tokens)[None], cache=cache)
    outs, chosen = [np.array(logits.astype(mx.float32))], []
    for step in range(steps):
        tok = int(mx.argmax(logits[0, -1]).item()) if forced is None else forced[step]
        chosen.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
        outs.append(np.array(logits.astype(mx.float32)))
    return outs, chosen


def assert_bitwise(ref: list[np.ndarray], got: list[np.ndarray]) -> None:
    assert len(ref) == len(got)
    for step, (a, b) in enumerate(zip(ref, got, strict=True)):
        diff = float(np.max(np.abs(a - b)))
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"step {step}: max |diff| = {diff}"


def make_resident_dir(full: Path, manifest: Any, out: Path, keep: Any = None) -> Path:
    """What setup installs, from a local checkpoint: configs, tokenizer and the resident file
    written by the same verified writer ``setup --stream`` uses (of the tensors in ``keep``)."""
    out.mkdir()
    for f in full.iterdir():
        if not f.name.startswith("model") or not f.name.endswith((".safetensors", ".json")):
            shutil.copy(f, out / f.name)

    async def fetch(file: str, start: int, end: int) -> bytes:
        with open(full / file, "rb") as fh:
            fh.seek(start)
            return fh.read(end - start)

    asyncio.run(ResidentWriter(manifest, out, keep).run(fetch, lambda n: None))
    return out


# Prefill steps (``prefill_step_size``) and prompts of 1, 2 and 5 steps: the loop's steps, then
# the last token's own (what ``generate_step`` does with ``steps * size + 1`` tokens).
PREFILL_SIZES = (16, 7)
PREFILL_STEPS = (1, 2, 5)
TEXT = ("Layer after layer, every chunk of the prompt meets the experts once; the cache streams "
        "them from the hub, verified, and the logits stay the resident model's, bit for bit. ")


def text_of(tokenizer: Any, n: int) -> str:
    """A text that ``stream_generate`` encodes (no chat template) to exactly ``n`` tokens."""
    text = TEXT * (1 + n // 40)
    while len(tokenizer.encode(text)) > n:
        text = text[:-1]
    assert len(tokenizer.encode(text)) == n, "the tokenizer cannot make this length"
    return text


def mlx_lm_logprobs(model: Any, tokenizer: Any, text: str, step: int,
                    max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and each one's logprob through ``mlx_lm.stream_generate``."""
    from mlx_lm import stream_generate

    tokens, logprobs = [], []
    for r in stream_generate(model, tokenizer, text, max_tokens=max_tokens,
                             prefill_step_size=step):
        tokens.append(int(r.token))
        logprobs.append(float(r.logprobs[r.token].item()))
    return tokens, logprobs


def cachecd_run_logprobs(socket: Path, repo: str, text: str, step: int,
                         max_tokens: int) -> tuple[list[int], list[float]]:
    """The same through ``cachecd run`` as a subprocess (its ``--json`` per-token logprob)."""
    import json

    from tests.harness import run_cli

    proc = run_cli("run", "--model", repo, "--socket", str(socket), "--json", "--no-chat",
                   "--prompt", text, "--max-tokens", str(max_tokens), "--prefill-step-size",
                   str(step))
    assert "prefill layer 1/" in proc.stderr, proc.stderr  # it ran layer by layer
    out = json.loads(proc.stdout)
    return out["tokens"], [r["logprob"] for r in out["per_token"]]


def write_format_checkpoints(root: Path, repos: dict[str, str]) -> None:
    """The tiny checkpoints the exactness tests serve, under ``root / repos[fmt]``, for each of
    the formats named: ``mxfp4`` and ``fp32`` tiny K3, ``int4`` and ``fp8`` tiny K2 (fp8 with
    whole and partial 128x128 blocks); both K2s with split experts."""
    from cachecd.testbed.tiny_k2 import K2Options, write_tiny_k2
    from cachecd.testbed.tiny_model import write_tiny_model

    for fmt, repo in repos.items():
        if fmt in ("mxfp4", "fp32"):
            write_tiny_model(root / repo, seed=0, fmt=fmt)
        else:
            options = K2Options(fmt="fp8", moe_intermediate=192) if fmt == "fp8" else K2Options()
            assert write_tiny_k2(root / repo, options, seed=0).split_experts


@contextmanager
def formats_served(prefix: str, repos: dict[str, str]) -> Iterator[tuple[Path, Any]]:
    """The per-format checkpoints (``write_format_checkpoints``) under a short temp dir, and
    one `cachecd hub serve` over them; both gone after."""
    from tests.harness import HubProcess, short_tmp

    root = short_tmp(prefix)
    write_format_checkpoints(root, repos)
    hub = HubProcess(root)
    try:
        yield root, hub
    finally:
        hub.stop()
        shutil.rmtree(root, ignore_errors=True)
