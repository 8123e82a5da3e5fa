"""Which resident tensors setup installs: what mlx-lm's own sanitize keeps, from metadata alone."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from mlx_lm.utils import load_model

from cachecd.setup.resident import skipped_summary
from cachecd.testbed.tiny_config import TinyOptions
from cachecd.testbed.tiny_k2 import K2Options, write_tiny_k2
from cachecd.testbed.tiny_model import write_with_info
from cachecd_engine.loader import load
from cachecd_engine.local_source import LocalSource, manifest_from_dir
from cachecd_engine.sanitize_keep import kept_names
from tests.exactness import assert_bitwise, make_resident_dir, run_logits

SMALL = TinyOptions(experts=8, layers=3, multimodal=True)
UNUSED = ("vision_tower.", "mm_projector.", "language_model.model.layers.3.")  # layer 3: MTP


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("mm") / "full"
    write_with_info(out, SMALL, seed=0, shard_bytes=64 * 1024)
    return out, manifest_from_dir(out, "cachecd/tiny-k3-mm")


def test_multimodal_repo_keeps_the_text_model_only(multimodal, tmp_path: Path) -> None:
    full, manifest = multimodal
    kept = kept_names(_config(full), manifest.resident)
    skipped = {t.name for t in manifest.resident} - kept
    assert skipped and all(n.startswith(UNUSED) for n in skipped)
    assert all(not n.startswith(UNUSED) for n in kept)
    # Kept too: tensors sanitize computes new arrays from (conv weights moved, A_log reshaped).
    assert any(n.endswith("q_conv1d.weight") for n in kept)
    assert any(n.endswith(".A_log") for n in kept)
    # What is kept is what the model loads: from a resident file of those alone (mlx-lm loads
    # strict: nothing missing, nothing extra), the streamed model computes the full one's logits.
    only = make_resident_dir(full, manifest, tmp_path / "text", keep=kept)
    reference, _ = load_model(full)
    with LocalSource(manifest, full) as source:
        model, tokenizer = load(only, source, ram_bytes=0)
        prompt = tokenizer.encode("only the text model is resident")
        ref, toks = run_logits(reference, prompt, steps=2)
        assert_bitwise(ref, run_logits(model, prompt, toks, steps=2)[0])


def test_fp8_scales_are_kept_with_their_weights(tmp_path: Path) -> None:
    """fp8 weights and their block scales become one bf16 array: both are kept."""
    out = write_tiny_k2(tmp_path / "k2", K2Options(fmt="fp8", experts=8, layers=3)).out
    manifest = manifest_from_dir(out, "cachecd/tiny-k2-fp8")
    kept = kept_names(_config(out), manifest.resident)
    assert kept == {t.name for t in manifest.resident}
    assert any(n.endswith("weight_scale_inv") for n in kept)


def test_anything_unexplained_keeps_everything(multimodal) -> None:
    """Installing too much costs disk; too little would fail the load: when unsure, keep all."""
    full, manifest = multimodal
    names = {t.name for t in manifest.resident}
    odd = [replace(t, dtype="F64") if i == 0 else t for i, t in enumerate(manifest.resident)]
    assert kept_names(_config(full), odd) == names  # a dtype it cannot mimic
    assert kept_names({"model_type": "no_such_model"}, manifest.resident) == names


def test_skipped_summary_names_the_subtrees() -> None:
    kept = ["language_model.model.layers.0.mlp.weight", "language_model.model.layers.1.x"]
    skipped = ["vision_tower.a.0.w", "vision_tower.b.w", "mm_projector.w",
               "language_model.model.layers.2.eh_proj.weight"]
    assert skipped_summary(skipped, kept) == (
        "vision_tower (2), mm_projector (1), language_model.model.layers.2 (1)")
    assert skipped_summary(skipped, kept, most=1) == "vision_tower (2) and 2 more"
