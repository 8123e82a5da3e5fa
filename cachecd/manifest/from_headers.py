"""A manifest made from a revision's safetensors headers alone, with no byte of a tensor read.

The expert map (which tensors are which expert, their shards, offsets, sizes, dtypes, shapes) is
the headers'; nothing was hashed, so every digest is a placeholder, distinct per tensor and never
the hash of any bytes. ``plan.hub_model`` plans with such a manifest and never saves it;
``setup --stream`` with no manifest installs by one made from headers it proved through Xet
(``made="headers"``): the daemon then learns each expert's digest from its proven bytes
(``Manifest.learn``), and setup each resident tensor's.
"""

from __future__ import annotations

import hashlib
from typing import Any

import xxhash

from cachecd.manifest.build_plan import Plan, SourceFile, quant_format_of
from cachecd.manifest.entries import FileInfo, TensorInfo
from cachecd.manifest.manifest import Manifest


def placeholder(name: str) -> bytes:
    """A tensor's or expert's digest before its bytes are known: distinct per name."""
    return xxhash.xxh3_128_digest(name.encode())


def manifest_from_plan(repo: str, revision: str, config: dict[str, Any], config_bytes: bytes,
                       files: list[SourceFile], plan: Plan, made: str | None = None,
                       sha256: dict[str, str] | None = None) -> Manifest:
    """The manifest of ``plan``'s headers; ``sha256``: each small file's, where the source
    listed none (a file the Hub keeps in git)."""
    from cachecd.manifest.build import _expert_entry

    digests = {t.name: placeholder(t.name) for s in plan.shards for t in s.tensors}
    header = {s.file.name: s.header_len for s in plan.shards}
    known = sha256 or {}
    infos = [FileInfo(f.name, f.size, f.sha256 or known.get(f.name) or "0" * 64,
                      header.get(f.name, 0)) for f in files]
    resident = [TensorInfo(t.name, t.dtype, t.shape, s.file.name, t.start, t.nbytes,
                           digests[t.name])
                for s in plan.shards for t in s.tensors if plan.owner[t.name] is None]
    experts = [_expert_entry(key, parts, digests, placeholder(f"expert {key}"))
               for key, parts in plan.expert_tensors.items()]
    return Manifest.from_entries(
        repo=repo, revision=revision, model_type=config["model_type"],
        quant_format=quant_format_of(config),
        config_sha256=hashlib.sha256(config_bytes).hexdigest(), files=infos, experts=experts,
        resident=resident, made=made)
