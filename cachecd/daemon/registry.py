"""Registered models: which repos the daemon may fetch for, each pinned by its manifest.

A registration is one repo at one commit; several revisions of a repo may be registered at once
(an update beside the installed one), each keyed ``ORG/NAME@COMMIT`` in the index. A request names
one as ``ORG/NAME@REV`` (the commit, 7+ of its first hex digits, or a branch or tag name setup was
given for it: ``model_names``) or as a bare ``ORG/NAME`` while only one revision of it is registered; a bare name with several is refused with the list
(``invalid_request``), never resolved by a guess.

Invariant: the daemon fetches nothing it cannot verify, so a repo without a registered manifest
is refused (403 ``repo_not_allowed``) before any I/O. A manifest that fails to load refuses that
model only; the others are still served. Two checks on use (``manifest.hub_check``; 422
``manifest_mismatch`` when either disagrees):

- the Hub's metadata for its commit; one that cannot be asked then (offline, no metadata API, no
  network) is registered with a warning, and the upstream compares each file with the Hub's size
  and sha256 when it first resolves it;
- its layout: every expert's tensors against the shards' safetensors headers at that commit
  (kept under ``models_dir/manifests/headers``). No expert of a model is served, hit or miss,
  until this has passed: one that cannot be checked at registration is checked again before its
  first expert is served, and until then such requests get 503 ``manifest_unchecked``. A pass
  is recorded with the registration (by the manifest's content), so a restart does not repeat it.

The daemon keeps its own copy of each manifest under ``models_dir/manifests`` so a registration
survives the caller's temp files; ``origin`` says where the caller got it (``built``,
``shipped``, a path or an ``hf://`` URL), for ``status``.

Each registration records the endpoint it was installed from (``endpoint``: what setup was given;
the daemon's own for ``serve --manifest``; None for one registered before this was recorded). A
daemon whose endpoint differs fetches none of that model's missing experts unless started with
``--allow-other-endpoint`` (``Daemon.ensure``: 409 ``endpoint_mismatch``); hits are served.

A registration may name a range of layers (``setup --pipeline R/N``: the layers mlx-lm gives that
pipeline rank); an expert of any other layer is refused (403 ``layer_not_served``) before any
I/O, so a rank's daemon only ever fetches and holds its own layers' experts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cachecd.daemon import learn, model_names
from cachecd.daemon.layout_gate import LayoutGate, in_thread
from cachecd.durable import write_atomic
from cachecd.errors import (
    CachecdError,
    InvalidRequest,
    LayerNotServed,
    ManifestMismatch,
    ManifestUnchecked,
    RedirectRefused,
    RepoNotAllowed,
    UpstreamAnswerInvalid,
)
from cachecd.manifest.manifest import Manifest
from cachecd.manifest.repo_ref import parse_ref
from cachecd.report.coverage import served_mask
from cachecd.store.store import Store

log = logging.getLogger(__name__)

# What refuses a model at registration (the rest leaves it registered, unchecked): the Hub's
# word against the manifest, and an answer about it that cachecd will not read or follow.
_REFUSES = (ManifestMismatch, UpstreamAnswerInvalid, RedirectRefused)


def check_restriction(layers: Any, pipeline: Any) -> tuple[tuple[int, int] | None,
                                                         tuple[int, int] | None]:
    """``layers`` ``[start, end)`` and ``pipeline`` ``[rank, size]`` of a registration, checked."""
    def pair(value: Any, what: str, ok: Any) -> tuple[int, int] | None:
        if value is None:
            return None
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
                or not ok(*value)):
            raise InvalidRequest(f"{what} must be {_PAIR_RULES[what]}, got {value!r}")
        return int(value[0]), int(value[1])

    got_layers = pair(layers, "layers", lambda a, b: 0 <= a < b)
    got_pipeline = pair(pipeline, "pipeline", lambda r, n: 0 <= r < n)
    if got_pipeline is not None and got_layers is None:
        raise InvalidRequest("a pipeline rank is registered with its layers: pass both")
    return got_layers, got_pipeline


def _label(origin: str | None, path: str) -> str:
    """How messages name a manifest: what the user gave (a file, an hf:// URL), else its path."""
    return origin if origin and origin not in ("built", "shipped", "headers") else path


_PAIR_RULES = {"layers": "[start, end] with 0 <= start < end", "pipeline": "[rank, size] with "
               "0 <= rank < size"}


@dataclass
class RegisteredModel:
    manifest: Manifest
    manifest_path: Path
    local_dir: Path | None
    layers: tuple[int, int] | None = None  # [start, end): the only layers served
    pipeline: tuple[int, int] | None = None  # (rank, size) those layers are mlx-lm's split of
    origin: str | None = None  # where the registering caller got the manifest
    layout_checked: bool = False  # its ranges agree with the shards' headers: experts may flow
    record_key: str = ""  # its record's key in the index (``REPO@COMMIT``; ``REPO`` before 30)
    endpoint: str | None = None  # where it was installed from (None: not recorded)
    names: tuple[str, ...] = ()  # revision names (branches, tags) setup installed it as
    _served: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def repo(self) -> str:
        return self.manifest.repo

    @property
    def commit(self) -> str:
        return self.manifest.revision

    @property
    def name(self) -> str:
        """``ORG/NAME@COMMIT``: names this registration whatever else of the repo is registered."""
        return f"{self.manifest.repo}@{self.manifest.revision}"

    def serves(self, layer: int) -> bool:
        return self.layers is None or self.layers[0] <= layer < self.layers[1]

    def check_layer(self, layer: int) -> None:
        if not self.serves(layer):
            raise LayerNotServed(
                f"layer {layer} of {self.repo} is not this daemon's: it is registered for "
                f"{self.scope()} only; ask the daemon of the machine that runs layer {layer} "
                f"(cachecd run --socket with {{rank}}), or run setup without --pipeline")

    def scope(self) -> str:
        if self.layers is None:
            return "every layer"
        start, end = self.layers
        rank = f" (pipeline rank {self.pipeline[0]} of {self.pipeline[1]})" if self.pipeline else ""
        return f"layers {start}-{end - 1}{rank}"

    def served_rows(self) -> np.ndarray:
        """Per manifest row: whether this daemon serves that expert."""
        if self._served is None:
            self._served = served_mask(self.manifest, self.layers)
        return self._served

    def describe(self) -> dict[str, Any]:
        m = self.manifest
        served = self.served_rows()
        return {
            "repo": m.repo,
            "revision": m.revision,
            "names": list(self.names),
            "model_type": m.model_type,
            "quant_format": m.quant_format,
            "manifest": str(self.manifest_path),
            "local_dir": str(self.local_dir) if self.local_dir else None,
            "experts_total": m.n_experts,
            "expert_bytes_total": m.expert_bytes_total,
            "resident_bytes_total": m.resident_bytes_total,
            "layers": list(self.layers) if self.layers else None,
            "pipeline": ({"rank": self.pipeline[0], "size": self.pipeline[1]}
                         if self.pipeline else None),
            "experts_served": int(served.sum()),
            "expert_bytes_served": int(m.sizes[served].sum()),
            "manifest_origin": self.origin,
            "manifest_made": m.made,
            "layout_checked": self.layout_checked,
            "endpoint": self.endpoint,
        }

    def other_endpoint(self, endpoint: str) -> bool:
        """Whether it was installed from another endpoint than ``endpoint``."""
        return self.endpoint is not None and not same_endpoint(self.endpoint, endpoint)


class Registry:
    """``check`` asks the Hub's metadata about a manifest before it is registered, ``layout``
    checks its ranges against the shards' headers (``hub_check``); a ``check`` of None (offline)
    registers without asking the metadata."""

    def __init__(self, store: Store, models_dir: Path,
                 check: Callable[[Manifest], None] | None = None,
                 layout: Callable[[Manifest], None] | None = None) -> None:
        self._store = store
        self._dir = models_dir / "manifests"
        # (repo, commit) -> registration: several revisions of one repo may be registered at once.
        self._models: dict[tuple[str, str], RegisteredModel] = {}
        self._check = check
        self._layout = layout
        self._gate = LayoutGate(layout)
        self.refused: dict[str, str] = {}  # record key -> why its manifest was refused
        self.at_start: set[str] = set()  # repos `serve --manifest` registers at every start
        self.starting: set[str] = set()  # --manifest paths still being registered at start

    async def load_registered(self) -> None:
        for record in self._store.models():
            try:
                await self._activate(record)
            except CachecdError as exc:
                self.refused[record.get("key") or record.get("repo", "?")] = exc.message
                log.error("model refused repo=%s reason=%s", record.get("repo"), exc.message)

    async def _activate(self, record: dict[str, Any]) -> RegisteredModel:
        path = Path(record["manifest"])
        manifest = await asyncio.to_thread(Manifest.load, path)
        local = Path(record["local_dir"]) if record.get("local_dir") else None
        layers, pipeline = check_restriction(record.get("layers"), record.get("pipeline"))
        model = RegisteredModel(manifest, path, local, layers, pipeline, record.get("origin"),
                                record_key=record.get("key") or manifest.repo,
                                endpoint=record.get("endpoint"),
                                names=tuple(record.get("names") or ()))
        manifest.source = _label(model.origin, str(path))
        await asyncio.to_thread(learn.load, model)
        model.layout_checked = record.get("layout_checked") == await asyncio.to_thread(
            manifest.content_sha256)
        self._models[(manifest.repo, manifest.revision)] = model
        self.refused.pop(model.record_key, None)
        return model

    async def register(self, manifest_bytes: bytes, source: str, local_dir: str | None,
                       layers: Any = None, pipeline: Any = None,
                       origin: str | None = None, endpoint: str | None = None,
                       names: Any = None) -> RegisteredModel:
        """Register (or re-register, replacing the registration of that repo at that commit) a
        model; another revision of the repo stays registered beside it;
        ``layers`` ``[start, end)`` restricts the experts served, ``pipeline`` ``[rank, size]``
        says which pipeline rank those layers are; ``origin`` where the caller got it;
        ``endpoint`` where it was installed from; ``names`` the revision names (``v2``,
        ``main``) it answers to from now on, besides its commit."""
        layers, pipeline = check_restriction(layers, pipeline)
        given = model_names.check_names(names)
        manifest = await asyncio.to_thread(Manifest.from_bytes, manifest_bytes,
                                           _label(origin, source))
        content = await asyncio.to_thread(manifest.content_sha256)
        key = f"{manifest.repo}@{manifest.revision}"
        legacy = self._store.get_model(manifest.repo)  # a record from before revisions were keys
        if legacy is not None and legacy.get("revision") != manifest.revision:
            legacy = None
        before = self._store.get_model(key) or legacy or {}
        known: list[str] = list(before.get("names") or ())
        # Setup made this one from the shards' headers, each proven through Xet (``origin``
        # "headers" is setup's own word, never a file's): its layout is those headers.
        made_here = origin == "headers" and manifest.learns
        checked = await self._check_on_use(
            manifest, made_here or before.get("layout_checked") == content)
        self._dir.mkdir(parents=True, exist_ok=True)
        name = f"{manifest.repo.replace('/', '--')}--{manifest.revision}.manifest"
        path = self._dir / name
        await asyncio.to_thread(write_atomic, path, manifest_bytes)
        record = {
            "repo": manifest.repo,
            "revision": manifest.revision,
            "manifest": str(path),
            "local_dir": local_dir,
            "layers": list(layers) if layers else None,
            "pipeline": list(pipeline) if pipeline else None,
            "origin": origin,
            "layout_checked": content if checked else None,
            "endpoint": endpoint,
            "names": list(dict.fromkeys([*given, *known])),
        }
        self._take_names(manifest.repo, manifest.revision, given)
        self._store.put_model(key, record)
        if legacy is not None:
            self._store.delete_model(manifest.repo)
        model = RegisteredModel(manifest, path, Path(local_dir) if local_dir else None, layers,
                                pipeline, origin, checked, record_key=key, endpoint=endpoint,
                                names=tuple(dict.fromkeys([*given, *known])))
        await asyncio.to_thread(learn.load, model)
        self._models[(manifest.repo, manifest.revision)] = model
        self.refused.pop(key, None)
        self.refused.pop(manifest.repo, None)
        log.info("model registered repo=%s revision=%s experts=%d layers=%s layout_checked=%s",
                 manifest.repo, manifest.revision, manifest.n_experts,
                 model.scope().replace(" ", "_"), checked)
        return model

    def _take_names(self, repo: str, commit: str, names: tuple[str, ...]) -> None:
        """A name registered with ``commit`` leaves the repo's other registrations (a branch
        moved on), in memory and in their records."""
        for (r, other), m in self._models.items():
            if r != repo or other == commit or not set(m.names) & set(names):
                continue
            m.names = tuple(n for n in m.names if n not in names)
            record = self._store.get_model(m.record_key)
            if record is not None:
                self._store.put_model(m.record_key, {**record, "names": list(m.names)})

    async def _check_on_use(self, manifest: Manifest, layout_known: bool) -> bool:
        """A manifest the Hub's metadata or the shards' headers contradict is refused
        (``ManifestMismatch``). Metadata that cannot be asked now (offline, an endpoint without
        the metadata API, a network error) is a warning: the upstream still compares each file's
        size and sha256 with the Hub's when it first resolves the file. Whether the layout
        passed (``layout_known``: it did for this content before): False when it could not be
        checked now, so no expert flows until it has."""
        why = "offline (HF_HUB_OFFLINE)"
        if self._check is not None:
            try:
                await in_thread(self._check, manifest)
                why = ""
            except _REFUSES:
                raise
            except CachecdError as exc:
                why = exc.message
        if why:
            log.warning("manifest_unchecked repo=%s revision=%s reason=%s", manifest.repo,
                        manifest.revision, why)
        if layout_known or self._layout is None:
            return layout_known
        try:
            await in_thread(self._layout, manifest)
            return True
        except _REFUSES:
            raise
        except CachecdError as exc:
            log.warning("layout_unchecked repo=%s revision=%s reason=%s", manifest.repo,
                        manifest.revision, exc.message)
            return False

    async def check_layout(self, model: RegisteredModel) -> None:
        """Before the first expert of a model whose layout is not checked yet (``LayoutGate``):
        a mismatch refuses the model; a pass is recorded with its registration."""
        m = model.manifest
        try:
            await self._gate.ensure(model)
        except ManifestMismatch as exc:
            if self._models.get((m.repo, m.revision)) is model:
                del self._models[(m.repo, m.revision)]
            self.refused[model.record_key] = exc.message
            log.error("model refused repo=%s reason=%s", m.repo, exc.message)
            raise
        record = self._store.get_model(model.record_key)
        if record is not None and record.get("manifest") == str(model.manifest_path):
            self._store.put_model(model.record_key,
                                  {**record, "layout_checked": m.content_sha256()})

    async def unregister(self, spec: str) -> tuple[RegisteredModel | None, dict[str, Any]]:
        """Forget the registration ``spec`` (``ORG/NAME[@REV]``, as ``get``) names, in memory and
        durably in the index (a restart does not bring it back); its model (None if its manifest
        was refused) and its stored record. Other revisions of the repo stay registered."""
        refused = self._refused_key(spec)
        if refused is None and not self.matching(*parse_ref(spec, "")):
            raise RepoNotAllowed(f"{spec} is not registered with this daemon; `cachecd status` "
                                 "lists the models it has")
        model = None if refused else self.get(spec)
        key = model.record_key if model is not None else str(refused)
        record = self._store.get_model(key) or (
            {"repo": model.repo, "manifest": str(model.manifest_path), "local_dir": None}
            if model else None)
        if record is None:
            raise RepoNotAllowed(f"{spec} is not registered with this daemon; `cachecd status` "
                                 "lists the models it has")
        await asyncio.wrap_future(self._store.delete_model(key))
        if model is not None:
            self._models.pop((model.repo, model.manifest.revision), None)
        self.refused.pop(key, None)
        log.info("model unregistered repo=%s key=%s", record.get("repo"), key)
        return model, record

    def _refused_key(self, spec: str) -> str | None:
        """The key of a refused registration ``spec`` names (it has no model to match)."""
        repo, rev = parse_ref(spec, "")
        if self.matching(repo, rev):
            return None
        for key in self.refused:
            k_repo, _, k_rev = key.partition("@")
            if k_repo == repo and (not rev or model_names.names_rev(k_rev, rev)):
                return key
        return None

    def matching(self, repo: str, rev: str = "") -> list[RegisteredModel]:
        """The registrations of ``repo`` (at ``rev``: a commit, 7+ of its first hex digits, or a
        revision name it was installed as)."""
        return [m for m in self._models.values() if model_names.matches(m, repo, rev)]

    def get(self, spec: str) -> RegisteredModel:
        """The registration ``ORG/NAME`` or ``ORG/NAME@REV`` names. A bare name with several
        revisions registered is refused with the list to choose from: nothing picks one behind
        the caller's back."""
        repo, rev = parse_ref(spec, "")
        found = self.matching(repo, rev)
        if len(found) == 1:
            return found[0]
        if found:
            names = ", ".join(m.name for m in found)
            raise InvalidRequest(f"{len(found)} revisions of {repo} are registered ({names}): "
                                 f"name one with {repo}@REV")
        refused = self._refused_key(spec)
        why = self.refused.get(refused) if refused else None
        hint = f" (its manifest was refused: {why})" if why else ""
        if self.starting and not why:  # it may be one of them: ask again, not "not allowed"
            raise ManifestUnchecked(f"{spec} is not registered yet: the daemon is still checking "
                                    f"the manifests it was started with; retry in a moment")
        raise RepoNotAllowed(model_names.miss_message(spec, repo, rev, self.all(), hint))

    def all(self) -> list[RegisteredModel]:
        """In the order they were registered (at start: the index's order)."""
        return list(self._models.values())


def same_endpoint(a: str, b: str) -> bool:
    """One endpoint written two ways (a trailing slash) is the same endpoint."""
    return a.rstrip("/") == b.rstrip("/")
