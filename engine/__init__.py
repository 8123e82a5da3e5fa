"""MLX engine: mlx-lm models whose expert banks are streamed through the cachecd daemon.

Modules (imported on demand; importing this package does not import mlx):
``loader`` (load a model dir with streamed banks), ``streamed_moe`` (the bank, ExpertSource,
EngineStats), ``formats`` (expert bytes -> mx arrays), ``ram_tier`` (LRU of decoded experts),
``prefetch`` (next-layer hints), ``local_source`` (experts read from a local checkpoint),
``daemon_source`` (experts through the daemon), ``run`` (``cachecd run``).
"""

from typing import Any


def load(repo: str, socket: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a model installed with ``cachecd setup --stream``, as ``mlx_lm.load``
    returns them; every routed expert comes through the daemon on ``socket``. See ``run.load``."""
    from cachecd_engine.run import load as load_registered

    return load_registered(repo, socket, **kwargs)


__all__ = ["load"]
