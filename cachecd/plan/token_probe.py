"""The compute of a whole decode token, measured: the model's own mlx-lm classes built from its
config.json (every layer, attention, dense and shared experts, the head, the sampler's
log-softmax and argmax), with random weights in the checkpoint's dtype, its MoE layers'
routed experts at the manifest's shape and format (``probe._template``), timed on this machine's
default device with a KV cache.

Invariants:
- The routed experts compute as the engine computes them resident: top-k (the config's) of
  each token, in the manifest's quant format. The bank is built with top-k experts only (the
  router's picks are taken modulo top-k): equal experts compute as fast as others, and a bank of
  every expert would need the model's whole size in memory.
- Nothing here depends on the model's weights: the config and the manifest's shapes are enough,
  so a model not downloaded yet is probed the same way (``hub_model``).
- The model is built whole where its resident weights fit the memory the plan gives it (half
  the memory available, ``MAX_BUILD_BYTES`` at least): a run loads them all anyway. Else it is
  built with one layer and with as many as fit, and the token scaled from the two: its fixed
  part (embedding, head) and its cost per layer.
- What the engine adds per MoE layer call (its routing read-back, the bank's host work, the
  reads) is not here: ``probe.engine_costs`` measures it and ``speed`` adds it per call.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from cachecd.manifest.manifest import Manifest

MAX_BUILD_BYTES = 2 << 30  # resident weights built for the probe at most
PROMPT = 8  # tokens in the KV cache before the timed decode steps


def top_k_of(config: dict[str, Any]) -> int:
    """Experts a token routes to, as the config names it (0 if it does not): the key the
    engine's loader reads."""
    for c in (config, config.get("text_config") or {}):
        for key in ("num_experts_per_tok", "num_experts_per_token"):
            if isinstance(c.get(key), int):
                return int(c[key])
    return 0


def checkpoint_dtype(config: dict[str, Any], manifest: Manifest) -> str:
    """The dtype a run computes in: the resident float tensors' (most bytes), which mlx-lm
    loads as stored; else the config's ``torch_dtype``; else bfloat16."""
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    by: dict[str, int] = {}
    for t in manifest.resident:
        if t.dtype in names:
            by[names[t.dtype]] = by.get(names[t.dtype], 0) + t.nbytes
    if by:
        return max(by, key=lambda d: by[d])
    for c in (config, config.get("text_config") or {}):
        if c.get("torch_dtype") in names.values():
            return str(c["torch_dtype"])
    return "bfloat16"


def _layers(config: dict[str, Any]) -> int:
    return int((config.get("text_config") or config)["num_hidden_layers"])


def _with_layers(config: dict[str, Any], n: int) -> dict[str, Any]:
    out = dict(config)
    if isinstance(config.get("text_config"), dict):
        out["text_config"] = {**config["text_config"], "num_hidden_layers": n}
    out["num_hidden_layers"] = n
    return out


def token_s(config: dict[str, Any], manifest: Manifest, top_k: int, dtype: str,
            reps: int = 9, max_bytes: int = MAX_BUILD_BYTES) -> float:
    """Median seconds of a decode token of the whole model (see the module docstring); built
    whole where its resident weights fit ``max_bytes`` (a run loads them all anyway)."""
    layers = _layers(config)
    if manifest.resident_bytes_total <= max_bytes or layers <= 2:
        return _timed(config, manifest, top_k, dtype, reps)
    # Two truncated builds, one layer and as many as fit: their difference is a layer's cost
    # (the widest gap: the difference's noise is multiplied by layers / gap).
    per_layer = manifest.resident_bytes_total / layers
    big = max(2, min(layers - 1, int(max_bytes / per_layer)))
    a = _timed(_with_layers(config, 1), manifest, top_k, dtype, reps)
    b = _timed(_with_layers(config, big), manifest, top_k, dtype, reps)
    return a + (layers - 1) * max(0.0, (b - a) / (big - 1))


def _top_k_bank(glu: Any, k: int) -> Any:
    """The routed experts of one MoE layer as ``switch_mlp``: top-k of them, resident."""
    import mlx.nn as nn

    class TopK(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.glu = glu

        def __call__(self, x: Any, indices: Any) -> Any:
            return self.glu(x, indices % k)

    return TopK()


def build(config: dict[str, Any], manifest: Manifest, top_k: int, dtype: str) -> Any:
    """The model of ``config`` with random weights, its routed experts top-k resident (``_top_k_bank``)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    from cachecd.plan.probe import _template

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    glu = None
    for layer in model.layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "switch_mlp"):
            glu = glu or _template(manifest, top_k, dtype)  # one set of weights, shared
            # Lazy: the class's own bank of every expert is never evaluated.
            mlp.switch_mlp = _top_k_bank(glu, top_k)
    q = config.get("quantization")
    if isinstance(q, dict) and q.get("bits"):  # mlx-lm's own quantized checkpoints
        gs = int(q.get("group_size", 64))
        nn.quantize(model, gs, int(q["bits"]), mode=q.get("mode", "affine"),
                    class_predicate=lambda _p, m: hasattr(m, "to_quantized")
                    and m.weight.shape[-1] % gs == 0)
    model.set_dtype(getattr(mx, dtype))
    for layer in model.layers:  # a layer at a time: its float32 init freed before the next
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def _timed(config: dict[str, Any], manifest: Manifest, top_k: int, dtype: str,
           reps: int) -> float:
    """Median seconds of a decode step as mlx-lm's loop makes it: the forward with a KV cache,
    the log-softmax and the argmax, evaluated; after two untimed steps."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = build(config, manifest, top_k, dtype)
    cache = make_prompt_cache(model)
    vocab = int((config.get("text_config") or config).get("vocab_size") or 2)
    logits = model(mx.array([[i % vocab for i in range(PROMPT)]]), cache=cache)
    mx.eval(logits)
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        tok = mx.argmax(logits[:, -1], axis=-1)
        logits = model(tok[:, None], cache=cache)
        logprobs = logits[:, -1] - mx.logsumexp(logits[:, -1], keepdims=True)
        mx.eval(logits, logprobs)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
