"""Load an mlx-lm model whose routed experts stream from an ExpertSource.

Invariants:
- Everything except the routed experts loads exactly as ``mlx_lm.utils.load_model`` loads it
  (same classes, same sanitize, same quantization decisions, same dtypes).
- No routed-expert byte is read at load: expert keys are dropped before mlx-lm's sanitize, and
  ``mx.load`` is lazy, so even a full checkpoint directory costs only its resident bytes.
- The streamed banks hold no parameters, so ``load_weights(strict=True)`` and ``nn.quantize``
  never see them.
- Pipelined (a ``pipeline`` group): mlx-lm's own ``pipeline(group)`` splits the layers right after
  its sanitize, so quantization and the strict load see this rank's layers only (with the
  embeddings, norm and head every rank keeps) and only its layers' banks remain.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
from mlx import nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes, load_model, load_tokenizer

from cachecd import constants, errors
from cachecd.manifest.manifest import EXPERT_RE, Manifest
from cachecd_engine.formats import quant_spec
from cachecd_engine.pipeline import barrier, weights_of_rank
from cachecd_engine.pool.bank import EngineStats, ExpertBank, ExpertSource
from cachecd_engine.pool.memory import PoolSizer, default_pool_bytes
from cachecd_engine.pool.prefetch import read_ahead_by_default
from cachecd_engine.pool.slots import DEFAULT_POLICY
from cachecd_engine.pool.speculate import Speculator, speculate_by_default
from cachecd_engine.prefill import driver_for
from cachecd_engine.prefill_batch import BatchAhead
from cachecd_engine.prefill_defer import Deferral
from cachecd_engine.streamed_moe import StreamedSwitchGLU, install_prefetch, install_streamed_banks
from cachecd_engine.tokenizer import tokenizer_options

# Model types whose MoE layers expose ``mlp.switch_mlp`` as a SwitchGLU (the hook point); setup
# refuses the others before it installs anything.
SUPPORTED_MODEL_TYPES = constants.SUPPORTED_MODEL_TYPES


def is_expert_weight(key: str) -> bool:
    """A routed-expert key, per-expert (checkpoint) or already stacked (mlx format)."""
    return EXPERT_RE.search(key) is not None or ".switch_mlp." in key


def drop_expert_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    return {k: v for k, v in weights.items() if not is_expert_weight(k)}


def streamed_classes(bank: ExpertBank,
                     pipeline: Any = None) -> Callable[[dict], tuple[type[nn.Module], type]]:
    """A ``get_model_classes`` for mlx-lm's ``load_model`` that builds streamed models, split
    over ``pipeline`` (an ``mx.distributed`` group) if given."""

    def get_classes(config: dict) -> tuple[type[nn.Module], type]:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise errors.UnsupportedFormat(
                f"model_type {model_type!r} cannot be streamed yet; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        # mlx-lm's own choice of classes (it remaps model types), so the base is what
        # load_model would build.
        model_class, args_class = _get_classes(config)

        class StreamedModel(model_class):  # type: ignore[misc, valid-type]
            def __init__(self, args: Any) -> None:
                super().__init__(args)
                install_streamed_banks(self, bank)

            def __call__(self, inputs: mx.array, cache: Any = None, *args: Any,
                         **kwargs: Any) -> mx.array:
                base = super().__call__
                spec = bank.speculator

                def forward() -> mx.array:
                    if spec is None:
                        return base(inputs, cache, *args, **kwargs)
                    return spec.step(lambda: base(inputs, cache, *args, **kwargs), inputs, cache)

                deferral: Deferral | None = self.__dict__.get("deferral")
                ahead: BatchAhead | None = self.__dict__.get("ahead")
                if deferral is None or ahead is None:
                    return forward()
                frame, extra = sys._getframe(1), bool(args or kwargs)
                # mlx-lm's prefill loops drop their steps' output: those run layer by layer
                # (generate_step's held back, BatchGenerator's run ahead).
                return deferral.call(lambda: ahead.call(forward, inputs, cache, frame, extra),
                                     inputs, cache, frame, extra)

            def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
                weights = super().sanitize(drop_expert_weights(weights))
                if pipeline is None:
                    return weights
                # mlx-lm's sanitize walks every layer, so the split comes after it; load_model
                # quantizes and loads (strictly) what remains: this rank's layers.
                self.model.pipeline(pipeline)
                return weights_of_rank(weights, self.model.start_idx, self.model.end_idx)

        StreamedModel.__name__ = f"Streamed{model_class.__name__}"
        return StreamedModel, args_class

    return get_classes


def _top_k(config: dict[str, Any]) -> int:
    """Experts a token routes to, as the model's config names it (0 if it does not)."""
    for c in (config, config.get("text_config") or {}):
        for key in ("num_experts_per_tok", "num_experts_per_token"):
            if isinstance(c.get(key), int):
                return int(c[key])
    return 0


def _streamed_banks(model: nn.Module) -> list[StreamedSwitchGLU]:
    return [m for _, m in model.named_modules() if isinstance(m, StreamedSwitchGLU)]


class ManifestedSource(ExpertSource, Protocol):
    """A source the loader takes: its manifest says the experts' format and the files' pins."""

    manifest: Manifest


def load(
    model_dir: Path,
    source: ManifestedSource,
    *,
    ram_bytes: int | None = None,
    expert_memory: int | None = None,
    stats: EngineStats | None = None,
    lazy: bool = False,
    prefetch: bool | None = None,
    speculate: bool | None = None,
    ram_policy: str = DEFAULT_POLICY,
    model_config: dict[str, Any] | None = None,
    tokenizer_config: dict[str, Any] | None = None,
    return_config: bool = False,
    trust_remote_code: bool = False,
    pipeline: Any = None,
    layer_major: bool = True,
) -> tuple[nn.Module, TokenizerWrapper] | tuple[nn.Module, TokenizerWrapper, dict[str, Any]]:
    """(model, tokenizer) for ``mlx_lm.generate``/``stream_generate``; the bank is ``model.bank``.

    ``model_dir`` holds config.json, the tokenizer files and the resident weights
    (``model*.safetensors``); expert tensors there, if any, are ignored. ``ram_bytes`` is the pool
    of expert slots every MoE layer's kernel reads (default: measured once the resident model is
    loaded, and again while it runs, ``memory.default_pool_bytes``; 0: the smallest pool, two
    slots), ``expert_memory`` a cap on it. With ``prefetch`` each MoE layer reads ahead (or
    hints) the next layer's likely experts (``model.prefetcher``); by default only where the model
    computes on a GPU (``read_ahead_by_default``). ``model_config``, ``tokenizer_config`` and
    ``return_config`` are ``mlx_lm.load``'s (the config is the one ``load_model`` returns).
    A tokenizer with remote code loads only with ``trust_remote_code`` (or ``tokenizer_config``'s
    ``trust_remote_code``), and only if its code files have the sha256 the source's manifest
    pins (``cachecd_engine.tokenizer``); that is checked before the model is loaded.
    With ``layer_major`` (default) the prefill steps of mlx-lm's ``generate_step`` run layer by
    layer (``prefill_defer``: each layer's experts read once a prompt), and those of mlx-lm's
    ``BatchGenerator`` are run ahead layer by layer (``prefill_batch``); False: step by step.
    """
    model_dir = Path(model_dir)
    config = {**json.loads((model_dir / "config.json").read_text()), **(model_config or {})}
    if config.get("model_file"):  # load_model would build that file's classes, not streamed ones
        raise errors.NotStreamable(
            f"{model_dir}'s config names a custom model_file ({config['model_file']}); only "
            f"mlx-lm's own model classes can stream their experts")
    # The experts' format is the manifest's word (it was read from the pinned config.json when
    # the manifest was built), not worked out again here.
    manifest = source.manifest
    spec = quant_spec(manifest.quant_format)
    pins = {f.name: f.sha256 for f in manifest.files.values()}
    tokenizer_config = tokenizer_options(
        model_dir, tokenizer_config, trust_remote_code=trust_remote_code, pins=pins,
        repo=manifest.repo)
    bank = ExpertBank(source, spec, ram_bytes or 0, stats or EngineStats(), cap=expert_memory,
                      policy=ram_policy)
    model, config = load_model(model_dir, lazy=lazy, model_config=model_config,
                               get_model_classes=streamed_classes(bank, pipeline))
    if ram_bytes is None:  # measured now that the resident model takes its memory
        bank.pool_bytes = default_pool_bytes()
        bank.sizer = PoolSizer()
        bank.min_slots = max(bank.min_slots, 2 * _top_k(config))  # two decode calls at least
    moe = [glu.layer for glu in _streamed_banks(model)]
    if moe:
        bank.max_slots = len(moe) * bank.experts_per_layer
        bank.prepare(moe[0])  # allocates the pool
    object.__setattr__(model, "bank", bank)  # outside the module tree: not a parameter
    if speculate is None:
        speculate = speculate_by_default()
    if speculate and moe and pipeline is None:  # a pipelined step is split over ranks
        bank.speculator = Speculator(bank, moe)
    if prefetch is None:
        prefetch = read_ahead_by_default()
    pf = install_prefetch(model, bank) if prefetch else None
    object.__setattr__(model, "prefetcher", pf)
    object.__setattr__(model, "deferral", Deferral(model, bank, on=layer_major))
    object.__setattr__(model, "ahead", BatchAhead(driver_for(model), bank, on=layer_major))
    tokenizer = load_tokenizer(model_dir, tokenizer_config, eos_token_ids=config.get("eos_token_id"))
    if pipeline is not None:
        barrier(pipeline)  # as sharded_load: no rank starts generating while another loads
    return (model, tokenizer, config) if return_config else (model, tokenizer)
