"""A LoRA adapter in mlx_lm.lora's own format (adapter_config.json + adapters.safetensors), made
with mlx-lm's tuner on the tiny checkpoint: what a user passes as --adapter-path."""

from __future__ import annotations

import json
from pathlib import Path

from tests.harness import short_tmp


def write_adapter(tiny_dir: Path, keys: list[str]) -> Path:
    """A LoRA adapter as mlx_lm.lora saves one, trained on nothing: random B so it changes logits."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    params = {"rank": 4, "scale": 20.0, "dropout": 0.0, "keys": keys}
    model, _ = mlx_lm.load(str(tiny_dir))
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(0)
    weights = {k: (mx.random.normal(v.shape) * 0.05 if k.endswith("lora_b") else v)
               for k, v in tree_flatten(model.parameters()) if k.endswith(("lora_a", "lora_b"))}
    out = short_tmp("cdad")
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}))
    return out
