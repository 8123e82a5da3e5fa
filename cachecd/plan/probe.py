"""The compute of a decode token, measured: one MoE layer of the manifest's expert shape and
quant format, as mlx-lm's ``SwitchGLU`` (the template the engine's bank calls) over ``top_k``
experts, timed on this machine's default device, times the model's MoE layers.

It measures the routed experts' compute, which is most of a decode token for a model whose
experts are big (K3's: 17.5 MB each, 16 a layer). Attention, shared experts and dense layers
are left out: for a model where they matter, give the token's compute (``--compute-ms``).
"""

from __future__ import annotations

import statistics
import time

from cachecd.manifest.manifest import Manifest


def expert_dims(manifest: Manifest) -> tuple[int, int]:
    """(hidden, intermediate) of an expert: the rows of its down and gate projections."""
    from cachecd_engine.formats import StackLayout

    layer = manifest.moe_layers[0]
    slots = StackLayout.of(manifest.expert(layer, 0)).slots
    rows = {s.key[0]: s.shape[0] for s in slots if s.key[1] in ("weight_packed", "weight")}
    return rows["down_proj"], rows["gate_proj"]


def moe_layer_s(manifest: Manifest, top_k: int, dtype: str = "float32", reps: int = 5) -> float:
    """Median seconds of one MoE layer's call for one token, after two warm-up calls."""
    import mlx.core as mx

    glu = _template(manifest, top_k, dtype)
    dt = getattr(mx, dtype)
    x = mx.random.normal((1, 1, expert_dims(manifest)[0])).astype(dt)
    idx = mx.arange(top_k, dtype=mx.uint32).reshape(1, 1, top_k)
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        mx.eval(glu(x, idx))
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _template(manifest: Manifest, top_k: int, dtype: str) -> object:
    """mlx-lm's SwitchGLU with ``top_k`` experts of the manifest's shape and format. Each
    projection is made (and quantized) once and repeated: mlx-lm's own constructor makes every
    expert in fp32 first (GBs at K3's size), and equal experts compute as fast as others."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    from cachecd_engine.formats import quant_spec

    hidden, inter = expert_dims(manifest)
    spec = quant_spec(manifest.quant_format)
    dt = getattr(mx, dtype)
    glu = SwitchGLU(32, 32, top_k)  # small; its parameters are replaced below
    if spec.mode is not None:
        nn.quantize(glu, group_size=spec.group_size, bits=spec.bits, mode=spec.mode)
    for name, (out, inp) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                             ("down_proj", (hidden, inter))):
        w = (mx.random.normal((out, inp)) * inp ** -0.5).astype(dt)
        if spec.mode is None:
            params = {"weight": w}
        else:
            q = mx.quantize(w, spec.group_size, spec.bits, mode=spec.mode)
            params = dict(zip(("weight", "scales", "biases"), q, strict=False))
            params = {k: v.astype(dt) if k == "biases" else v for k, v in params.items()}
        getattr(glu, name).update({k: mx.repeat(v[None], top_k, axis=0)
                                   for k, v in params.items()})
    glu.set_dtype(dt)
    mx.eval(glu.parameters())
    return glu


def token_compute_s(manifest: Manifest, top_k: int, dtype: str = "float32") -> float:
    return moe_layer_s(manifest, top_k, dtype) * len(manifest.moe_layers)
