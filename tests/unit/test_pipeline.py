"""A pipeline rank's share of a model: the layers mlx-lm's own ``pipeline(group)`` gives it, the
tensors it installs and loads, and the streamed banks it keeps; and the per-rank view of the
daemon's numbers (coverage, warm plan, status). Real tiny checkpoints on disk; the only thing
stood in for is the group's network (``barrier``), as no second rank runs in-process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from cachecd.ctl.cache import render_status
from cachecd.ctl.coverage import Snapshot
from cachecd.ctl.warm import _served_share
from cachecd.daemon.registry import RegisteredModel, check_restriction
from cachecd.errors import InvalidRequest, LayerNotServed
from cachecd.manifest.manifest import Manifest, shipped_manifest
from cachecd.report.coverage import coverage_report
from cachecd.report.coverage_render import render_table
from cachecd.setup.pipeline import parse_rank, rank_dir
from cachecd.testbed.tiny_k2 import K2Options, write_tiny_k2
from cachecd.testbed.tiny_model import write_tiny_model
from cachecd_engine import loader
from cachecd_engine.local_source import LocalSource, manifest_from_dir
from cachecd_engine.pipeline import (
    RankGroup,
    RankLayers,
    layer_of,
    rank_layers,
    rank_path,
    rank_tensors,
    weights_of_rank,
)
from cachecd_engine.streamed_moe import StreamedSwitchGLU


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    out = write_tiny_model(tmp_path_factory.mktemp("tiny") / "k3")
    return out, manifest_from_dir(out, "cachecd/tiny-k3")


@pytest.fixture(scope="module")
def m() -> Manifest:
    path = shipped_manifest("cachecd/tiny-k3")
    assert path is not None
    return Manifest.load(path)


@pytest.mark.parametrize("size", [2, 3, 4, 6])
def test_ranks_tile_the_layers_rank_zero_last(tiny: tuple[Path, Manifest], size: int) -> None:
    config = json.loads((tiny[0] / "config.json").read_text())
    split = [rank_layers(config, r, size) for r in range(size)]
    assert split[0].end == 6 and split[-1].start == 0  # rank 0 runs the last layers
    for a, b in zip(split[1:], split[:-1], strict=True):
        assert a.end == b.start  # rank r+1's layers come right before rank r's
    assert {layer for s in split for layer in range(s.start, s.end)} == set(range(6))


def test_deepseek_layout_splits_with_mlx_lms_pipeline_mixin(tmp_path: Path) -> None:
    info = write_tiny_k2(tmp_path / "k2", K2Options())
    config = json.loads((info.out / "config.json").read_text())
    layers = config["num_hidden_layers"]
    split = [rank_layers(config, r, 2) for r in range(2)]
    assert (split[1].start, split[0].end, split[1].end) == (0, layers, split[0].start)


def test_too_many_ranks_and_bad_specs_are_refused(tiny: tuple[Path, Manifest]) -> None:
    config = json.loads((tiny[0] / "config.json").read_text())
    with pytest.raises(InvalidRequest, match="rank 0 gets none; use at most 6 ranks"):
        rank_layers(config, 0, 7)
    assert parse_rank("1/2") == (1, 2) and parse_rank(" 0 / 4 ") == (0, 4)
    for bad in ("2/2", "0/1", "1", "a/b", "-1/2"):
        with pytest.raises(InvalidRequest):
            parse_rank(bad)
    assert rank_dir(Path("/m/o/n/c"), 1, 2) == Path("/m/o/n/c/pipeline-1-of-2")


def test_a_rank_keeps_its_layers_and_what_every_rank_keeps() -> None:
    names = ["language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
             "language_model.model.norm.weight", "language_model.model.layers.2.mlp.gate.weight",
             "language_model.model.layers.3.self_attn.q_proj.weight",
             "language_model.model.layers.12.mlp.gate.weight"]
    mine = rank_tensors(names, RankLayers(0, 2, 3, 6, 6))
    assert mine == {names[0], names[1], names[2], names[4]}
    assert layer_of(names[5]) == 12 and layer_of(names[0]) is None
    assert set(weights_of_rank(dict.fromkeys(names), 0, 3)) == {*names[:4]}
    assert rank_path("/r/{rank}/s.sock", 1) == "/r/1/s.sock" and rank_path(None, 1) is None


def _rank_only_dir(src: Path, manifest: Manifest, layers: Any, out: Path) -> Path:
    """The tiny checkpoint's config and tokenizer, and only the rank's resident tensors."""
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("model*.safetensors", "*.index.json"))
    weights: dict[str, mx.array] = {}
    for f in src.glob("model*.safetensors"):
        weights.update(mx.load(str(f)))
    keep = rank_tensors([t.name for t in manifest.resident], layers)
    mx.save_safetensors(str(out / "model-resident.safetensors"),
                        {k: v for k, v in weights.items() if k in keep})
    return out


def test_loader_keeps_only_the_ranks_layers_and_stays_strict(
        tiny: tuple[Path, Manifest], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "barrier", lambda group: None)  # no peer in-process
    src, manifest = tiny
    config = json.loads((src / "config.json").read_text())
    rank1 = rank_layers(config, 1, 2)
    only1 = _rank_only_dir(src, manifest, rank1, tmp_path / "rank1")
    model, _ = loader.load(only1, LocalSource(manifest, src), ram_bytes=0,
                           pipeline=RankGroup(1, 2))
    banks = sorted(m.layer for _, m in model.named_modules() if isinstance(m, StreamedSwitchGLU))
    assert banks == [1, 2]
    params = [k for k, _ in tree_flatten(model.parameters())]
    assert {layer_of(k) for k in params} - {None} == {0, 1, 2}
    assert any("embed_tokens" in k for k in params) and any("lm_head" in k for k in params)
    # Rank 0's layers are not in rank 1's install: mlx-lm's strict load says so.
    with pytest.raises(ValueError, match="Missing"):
        loader.load(only1, LocalSource(manifest, src), ram_bytes=0, pipeline=RankGroup(0, 2))
    # A whole install serves any rank.
    full, _ = loader.load(src, LocalSource(manifest, src), ram_bytes=0, pipeline=RankGroup(0, 2),
                          prefetch=True)
    assert sorted(full.prefetcher.next_gates) == [3, 4]  # keyed by each bank's own layer
    assert [g[0] for g in full.prefetcher.next_gates.values()] == [4, 5]


def test_registration_restriction_is_checked_and_enforced(m: Manifest) -> None:
    assert check_restriction(None, None) == (None, None)
    assert check_restriction([3, 6], [0, 2]) == ((3, 6), (0, 2))
    for layers, pipeline in (([3, 3], None), ([4, 2], None), ([1], None), (["0", 3], None),
                             (None, [0, 2]), ([0, 3], [2, 2]), ([True, 3], None)):
        with pytest.raises(InvalidRequest):
            check_restriction(layers, pipeline)
    model = RegisteredModel(m, Path("x"), None, (3, 6), (0, 2))
    model.check_layer(3)
    model.check_layer(5)
    for layer in (2, 6):
        with pytest.raises(LayerNotServed, match="layers 3-5 \\(pipeline rank 0 of 2\\)"):
            model.check_layer(layer)
    d = model.describe()
    served = (m.layer_ids >= 3) & (m.layer_ids < 6)
    assert d["layers"] == [3, 6] and d["pipeline"] == {"rank": 0, "size": 2}
    assert d["experts_served"] == int(served.sum()) == 3 * m.experts_per_layer
    assert d["expert_bytes_served"] == int(m.sizes[served].sum())
    whole = RegisteredModel(m, Path("x"), None).describe()
    assert whole["experts_served"] == m.n_experts and whole["layers"] is None
    line = render_status({"pid": 1, "uptime_s": 1, "version": "v", "socket": "s",
                          "endpoint": "e", "cache_dirs": ["c"], "models": [d, whole]})
    assert line.count("serves    layers 3-5 only (pipeline rank 0 of 2)") == 1


def test_coverage_and_warm_cover_the_served_layers_only(m: Manifest) -> None:
    rng = np.random.default_rng(0)
    cached = rng.random(m.n_experts) < 0.5
    access = rng.integers(0, 5, m.n_experts)
    served = (m.layer_ids >= 1) & (m.layer_ids < 3)
    r = coverage_report(m, cached, access, layers=(1, 3))
    assert r["served_layers"] == [1, 3] and [row["layer"] for row in r["layers"]] == [1, 2]
    assert r["experts_total"] == int(served.sum())
    assert r["experts_cached"] == int((cached & served).sum())
    assert r["bytes_total"] == int(m.sizes[served].sum())
    assert r["accesses"] == int(access[served].sum())
    assert all(1 <= w["layer"] < 3 for w in r["most_wanted"])
    assert "serves     layers 1-2 only" in render_table({**r, "pipeline": {"rank": 1, "size": 2}})
    whole = coverage_report(m, cached, access)
    assert whole["served_layers"] is None and whole["experts_total"] == m.n_experts

    snap = Snapshot(m, cached, access, {}, (1, 3), {"rank": 1, "size": 2})
    share, notes = _served_share(snap, access, "trace t")
    assert share[served].tolist() == access[served].tolist() and not share[~served].any()
    assert f"{int(access[~served].sum())} accesses of trace t are other layers'" in notes[0]
    assert _served_share(Snapshot(m, cached, access, {}), access, "t") == (access, [])


def test_a_rank_loads_only_from_the_daemon_of_its_rank(tiny: tuple[Path, Manifest]) -> None:
    from cachecd.errors import NotStreamable
    from cachecd_engine.registered import check_rank, check_split

    rank1 = {"layers": [0, 3], "pipeline": {"rank": 1, "size": 2}}
    check_rank("o/n", {"layers": None}, RankGroup(0, 2), "s")  # a whole install: any rank
    check_rank("o/n", rank1, RankGroup(1, 2), "s")
    for group, why in ((None, "run it under mlx.launch with 2 ranks"),
                       (RankGroup(0, 2), "this process is pipeline rank 0 of 2"),
                       (RankGroup(1, 3), "this process is pipeline rank 1 of 3")):
        with pytest.raises(NotStreamable, match=why):
            check_rank("o/n", rank1, group, "s")
    check_split("o/n", rank1, RankGroup(1, 2), tiny[0], None)
    with pytest.raises(NotStreamable, match="mlx-lm gives this rank layers 0-2 of o/n, but its "
                                            "daemon serves layers 0-1"):
        check_split("o/n", {**rank1, "layers": [0, 2]}, RankGroup(1, 2), tiny[0], None)
