"""Shared checks for bit-identity: logits over a prefill plus greedy decode steps, compared bitwise."""

from __future__ import annotations

import asyncio
import shutil
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
