"""MLX engine: mlx-lm models whose expert banks are streamed through the cachecd daemon.

Modules (imported on demand; importing this package does not import mlx):
``loader`` (load a model dir with streamed banks), ``streamed_moe`` (the bank, ExpertSource,
EngineStats), ``arena`` (the stack buffers experts are read into), ``dispatch`` (the kernel each
call reaches), ``formats`` (expert bytes -> the kernel's arrays), ``ram_tier`` (hot experts in
memory), ``memory`` (default sizes), ``prefetch`` (next-layer read-ahead), ``local_source``
(experts read from a local checkpoint), ``daemon_source`` (experts through the daemon), ``run``
(``cachecd run``). See docs/architecture.md.
"""

from typing import Any


def load(repo: str, socket: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a model installed with ``cachecd setup --stream``, as ``mlx_lm.load``
    returns them; every routed expert comes through the daemon on ``socket``. See ``run.load``."""
    from cachecd_engine.run import load as load_registered

    return load_registered(repo, socket, **kwargs)


__all__ = ["load"]
