"""MLX engine: mlx-lm models whose expert banks are streamed through the cachecd daemon.

``cachecd_engine.load`` is ``mlx_lm.load`` for a model installed with ``cachecd setup --stream``
(``registered.load``): same arguments, same result, every routed expert through the daemon.

Modules (imported on demand; importing this package does not import mlx):
``registered`` (``load``), ``loader`` (load a model dir with streamed banks), ``streamed_moe``
(the ``switch_mlp`` mlx-lm calls), ``bank`` (a layer call over the pool of expert slots,
EngineStats), ``slots`` (which expert is in which slot), ``pool`` (the slots' memory), ``fill``
(experts into slots), ``calls`` (a call's rows as slots, groups), ``prefill``, ``prefill_defer`` and ``prefill_batch``
(mlx-lm's prefill steps run layer by layer: ``generate_step``'s, ``BatchGenerator``'s;
``prefill_chunks`` a caller's own loop of chunks), ``prefill_fallback`` (why a prefill runs step
by step, said once: ``PrefillStepByStep``), ``speculate`` (decode steps on
the device's slot map), ``cuda_memory`` (misses through the GPU's copy engine), ``dispatch`` (the
kernel each call reaches), ``formats`` (expert bytes -> the kernel's arrays), ``memory`` (the
pool's default size), ``prefetch`` (next-layer read-ahead), ``local_source`` (experts read from
a local checkpoint), ``daemon_source`` (experts through the daemon), ``tokenizer`` (the tokenizer, a
repo's remote code only trusted and pinned), ``remote_code`` (those pins checked where
transformers imports the code), ``sanitize_keep`` (the resident tensors mlx-lm's
model keeps), ``pipeline`` (a rank's layers over several machines), ``run`` (``cachecd run``),
``openai_server`` (``cachecd openai``), ``request_view`` (the cache's view of one request).
See docs/architecture.md.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # ``load`` itself, with mlx_lm.load's signature, without importing mlx with the package.
    if name == "load":
        from cachecd_engine.registered import load

        return load
    if name == "prefill_chunks":  # a caller's own loop of chunks, layer by layer
        from cachecd_engine.prefill_fallback import prefill_chunks

        return prefill_chunks
    if name == "PrefillStepByStep":  # the warning a prefill that runs step by step gives
        from cachecd_engine.prefill_fallback import PrefillStepByStep

        return PrefillStepByStep
    raise AttributeError(f"module 'cachecd_engine' has no attribute {name!r}")


__all__ = ["PrefillStepByStep", "load", "prefill_chunks"]
