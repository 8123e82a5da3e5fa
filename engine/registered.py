"""``cachecd_engine.load``: ``mlx_lm.load``'s signature and result for a model the daemon streams.

Invariants:
- ``path_or_hf_repo`` is the ORG/NAME ``cachecd setup --stream`` registered with the daemon. The
  resident weights, config and tokenizer come from the files setup installed; every routed expert
  comes through the daemon. A local folder or an unregistered repo is a one-line error naming
  what to run instead; nothing is downloaded here (setup owns downloads and pins the revision).
- Each mlx-lm argument means what it means to ``mlx_lm.load`` (the same ``load_model``,
  ``load_tokenizer`` and ``load_adapters`` do the work), or is refused with ``NotStreamable`` where
  streamed experts cannot honour it: a revision other than the pinned one, an adapter with
  expert weights, a config naming a custom ``model_file``.
- ``trust_remote_code`` does not mean what it means to mlx-lm. There it lets ``load_model``
  import and run the config's ``model_file`` (a custom architecture); here it lets transformers
  run the code the repo's configs name for the config and tokenizer (Kimi's
  ``tokenization_kimi.py``, a ``configuration_*.py``), each file pinned by the manifest's sha256
  and checked before it is imported. A ``model_file`` is refused whatever it says.
- Under ``mlx.launch`` (more than one rank) the model is split as mlx-lm's ``pipeline(group)``
  splits it and each rank reads its experts from its own daemon (``{rank}`` in ``socket``); a
  daemon registered for one rank's layers serves only that rank.
"""

from __future__ import annotations

import atexit
import re
from pathlib import Path
from typing import Any

from cachecd.errors import NotStreamable

# An HF repo id as the daemon names models: exactly one slash, no leading "." or "/"; with
# ``@REV`` (a commit, or 7+ of its hex digits) when several revisions of it are registered.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w.-]+)?")


def load(
    path_or_hf_repo: str,
    tokenizer_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    adapter_path: str | None = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: str | None = None,
    trust_remote_code: bool = False,
    *,
    socket: str | Path | None = None,
    ram_bytes: int | None = None,
    expert_memory: int | None = None,
    stats: Any = None,
    trace: str | Path | None = None,
    prefetch: bool | None = None,
    speculate: bool | None = None,
    pipeline: Any = None,
    layer_major: bool = True,
) -> Any:
    """``(model, tokenizer)``, or ``(model, tokenizer, config)`` with ``return_config``, exactly as
    ``mlx_lm.load`` returns them for the same arguments; ``mlx_lm.generate``, ``stream_generate``
    and ``mlx_lm.server`` work unchanged on the result.

    ``path_or_hf_repo`` is an ORG/NAME installed with ``cachecd setup --stream``; ``revision``, if
    given, must be the commit setup pinned (or 7+ of its first hex digits), or the branch or
    tag setup was given for it (``setup --stream ORG/NAME@v2``: ``revision="v2"``). An adapter may change resident weights only
    (``mlx_lm.tuner``'s ``load_adapters``).

    ``trust_remote_code=True`` trusts other code than mlx-lm's does. In ``mlx_lm.load`` it lets
    ``load_model`` import and run the Python file a config names in ``model_file`` to build a
    custom architecture. Here it lets transformers run the code the repo's configs name in
    ``auto_map`` while the tokenizer loads (Kimi's ``tokenization_kimi.py``, and the
    ``configuration_*.py`` transformers builds the config with first), as
    ``tokenizer_config={"trust_remote_code": True}`` does in mlx-lm, each file only if it has the
    sha256 the manifest pins, in the install dir and in transformers' modules-cache copy it
    imports. A config's ``model_file`` is refused with or without it (``NotStreamable``): the
    engine streams experts by replacing the expert banks of mlx-lm's own model classes, which a
    custom file's classes do not have, and the file would run with nothing to check it against.

    Keyword-only, the engine's own: ``socket`` (the daemon's), ``ram_bytes`` (the pool of expert
    slots; default: measured), ``expert_memory`` (a cap on the pool), ``stats`` (an
    ``EngineStats`` to count into), ``trace`` (record the routing to this file), ``prefetch``
    (read ahead the next layer's experts into free slots; default: off),
    ``speculate`` (decode steps on the device's expert -> slot map, no per-layer read-back
    when every routed expert is in the pool; default: on a GPU),
    ``pipeline`` (None: split the layers over the ranks when ``mlx.launch`` started more than
    one, as mlx-lm's ``sharded_load`` does; an ``mx.distributed`` group: split over it; False:
    run every layer). Pipelined, ``{rank}`` in ``socket`` or ``trace`` becomes this rank.
    ``layer_major`` (default on): mlx-lm's prefill steps run layer by layer, each layer's
    experts read once a prompt (``prefill_defer``); False: step by step, as mlx-lm runs them.
    """
    from cachecd_engine.daemon_source import DaemonSource
    from cachecd_engine.loader import load as load_dir
    from cachecd_engine.pipeline import launched_group, rank_path

    repo = check_name(path_or_hf_repo)
    group = launched_group() if pipeline is None else pipeline or None
    if group is not None:
        from cachecd_client.api import default_socket

        socket = rank_path(socket if socket is not None else default_socket(), group.rank())
        trace = rank_path(trace, group.rank())
    source, local_dir = DaemonSource.connect(repo, socket)
    try:
        check_model_file(repo, local_dir, model_config, trust_remote_code)
        check_revision(repo, source.manifest.revision, revision, source.info.get("names") or ())
        check_rank(repo, source.info, group, source.client.socket)
        check_split(repo, source.info, group, local_dir, model_config)
        if adapter_path is not None:
            check_adapter(Path(adapter_path))
        model, tokenizer, config = load_dir(
            local_dir, source, ram_bytes=ram_bytes, expert_memory=expert_memory, stats=stats,
            lazy=lazy, prefetch=prefetch, speculate=speculate, model_config=model_config,
            tokenizer_config=tokenizer_config, return_config=True,
            trust_remote_code=trust_remote_code, pipeline=group, layer_major=layer_major)
        if adapter_path is not None:
            from mlx_lm.utils import load_adapters

            model = load_adapters(model, adapter_path)
            model.eval()
    except BaseException:
        source.close()
        raise
    attach_trace(model, repo.partition("@")[0], trace)
    return (model, tokenizer, config) if return_config else (model, tokenizer)


def check_name(path_or_hf_repo: str | Path) -> str:
    """The ORG/NAME to ask the daemon for, or a one-line error for anything else."""
    name = str(path_or_hf_repo)
    if _REPO_ID.fullmatch(name):
        return name
    if Path(name).expanduser().exists():
        raise NotStreamable(
            f"{name} is a local folder; cachecd_engine.load streams a model registered with the "
            f"daemon: load a local checkpoint with mlx_lm.load, or install ORG/NAME with "
            f"`cachecd setup --stream ORG/NAME` and load that name")
    raise NotStreamable(
        f"{name!r} is not a Hugging Face repo id (ORG/NAME); install one with "
        f"`cachecd setup --stream ORG/NAME` and load that name")


def check_model_file(repo: str, local_dir: Path, model_config: dict[str, Any] | None,
                     trust_remote_code: bool) -> None:
    """Refuse a config naming a custom ``model_file``, saying why (trusted or not)."""
    import json

    config = {**json.loads((Path(local_dir) / "config.json").read_text()), **(model_config or {})}
    model_file = config.get("model_file")
    if not model_file:
        return
    said = ("trust_remote_code=True here trusts the tokenizer's and config's pinned code, not "
            "that file; " if trust_remote_code else "")
    raise NotStreamable(
        f"{repo}'s config names a custom model_file ({model_file!r}), which mlx_lm.load would "
        f"import and run with trust_remote_code=True to build the model; {said}cachecd streams "
        f"experts only into mlx-lm's own model classes, whose expert banks it replaces, so it "
        f"does not run that file: load a full local checkpoint with mlx_lm.load(..., "
        f"trust_remote_code=True) if you trust it")


def check_revision(repo: str, pinned: str, asked: str | None, names: Any = ()) -> None:
    # A branch or tag is the one setup was given for this install (``names``), never resolved
    # against the Hub: setup pinned one commit and the daemon's manifest verifies its bytes only.
    if asked is None or (len(asked) >= 7 and pinned.startswith(asked)) or asked in names:
        return
    raise NotStreamable(
        f"{repo} is installed at commit {pinned}, not revision {asked!r}; run "
        f"`cachecd setup --stream {repo}@{asked}` to install that one, or pass revision=None")


def check_rank(repo: str, info: dict[str, Any], group: Any, socket: Any) -> None:
    """A daemon registered for one pipeline rank's layers serves that rank only."""
    served, rank = info.get("layers"), info.get("pipeline")
    if not served:
        return  # a whole install serves every rank
    scope = (f"layers {served[0]}-{served[1] - 1}"
             + (f" (pipeline rank {rank['rank']} of {rank['size']})" if rank else ""))
    if group is None:
        raise NotStreamable(
            f"the daemon at {socket} serves {scope} of {repo} only: run it under mlx.launch "
            f"with {rank['size'] if rank else 'its'} ranks, or `cachecd setup --stream {repo}` "
            f"without --pipeline for the whole model")
    if rank and (rank["rank"], rank["size"]) != (group.rank(), group.size()):
        raise NotStreamable(
            f"this process is pipeline rank {group.rank()} of {group.size()}, but the daemon at "
            f"{socket} serves {scope} of {repo}: give each rank its own daemon (`--socket "
            f"DIR/{{rank}}/s.sock`) or run `cachecd setup --stream {repo} --pipeline "
            f"{group.rank()}/{group.size()}` there")


def check_split(repo: str, info: dict[str, Any], group: Any, local_dir: Path,
                model_config: dict[str, Any] | None) -> None:
    """The layers mlx-lm gives this rank are within those setup installed and registered (the
    installed mlx-lm splits as the one at setup did)."""
    import json

    from cachecd_engine.pipeline import rank_layers

    served = info.get("layers")
    if group is None or not served:
        return
    config = {**json.loads((local_dir / "config.json").read_text()), **(model_config or {})}
    mine = rank_layers(config, group.rank(), group.size())
    if not served[0] <= mine.start < mine.end <= served[1]:
        raise NotStreamable(
            f"mlx-lm gives this rank layers {mine.start}-{mine.end - 1} of {repo}, but its "
            f"daemon serves layers {served[0]}-{served[1] - 1}: the installed mlx-lm splits "
            f"otherwise than at setup; run `cachecd setup --stream {repo} --pipeline "
            f"{group.rank()}/{group.size()}` again")


def check_adapter(adapter_path: Path) -> None:
    """Refuse an adapter that has expert weights: mlx-lm would apply them to a bank that is not
    there (the streamed bank has no parameters), and the experts are the Hub's bytes, verified."""
    from safetensors import safe_open

    from cachecd_engine.loader import is_expert_weight

    weights = adapter_path / "adapters.safetensors"
    if not weights.exists():
        return  # mlx-lm's load_adapters says what is missing
    with safe_open(str(weights), framework="numpy") as f:
        expert_keys = [k for k in f.keys() if is_expert_weight(k)]
    if expert_keys:
        raise NotStreamable(
            f"adapter {adapter_path} changes routed-expert weights ({expert_keys[0]}, "
            f"{len(expert_keys)} in all); streamed experts are the Hub's verified bytes: train "
            f"the adapter without the experts (lora_parameters keys), or fuse it (mlx_lm.fuse) "
            f"and run the fused checkpoint with mlx_lm.load")


def attach_trace(model: Any, repo: str, path: str | Path | None) -> None:
    """Record the routing to ``path`` (or ``CACHECD_TRACE``), after the runs already in it;
    closed at exit."""
    from cachecd import constants
    from cachecd_engine.trace import TraceRecorder

    path = path or constants.TRACE_PATH
    if path:
        recorder = TraceRecorder(path, repo, append=True)
        model.bank.trace = recorder
        atexit.register(recorder.close)
