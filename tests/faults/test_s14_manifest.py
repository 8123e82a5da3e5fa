"""Scenario 14: bad manifests. Bad meta JSON, a 15-byte digest, overlapping ranges, a range past
its file and revision "main" each fail with manifest_invalid naming the file and the field;
that model is refused (at registration, at start, or when its stored copy rots between runs)
and the other models are still served."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest

from cachecd.errors import ManifestInvalid, RepoNotAllowed
from tests.faults.figures import FIGURES
from tests.faults.support import Model, fetch_verified, new_dir


def _rewrite(model: Model, meta_fn: Any = None, arrays_fn: Any = None, raw_meta: bytes | None = None) -> bytes:
    with np.load(io.BytesIO(model.manifest_path.read_bytes()), allow_pickle=False) as npz:
        arrays = {k: npz[k].copy() for k in npz.files}
    meta = json.loads(arrays.pop("meta").tobytes())
    if meta_fn:
        meta_fn(meta)
    if arrays_fn:
        arrays_fn(arrays)
    blob = raw_meta if raw_meta is not None else json.dumps(meta).encode()
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.frombuffer(blob, np.uint8), **arrays)
    return buf.getvalue()


def _overlap(a: dict[str, np.ndarray]) -> None:
    a["r_start"][1], a["r_end"][1] = a["r_start"][0], a["r_end"][0]


def _past_end(a: dict[str, np.ndarray]) -> None:
    a["r_end"][-1] += 10_000_000


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "bad JSON": ({"raw_meta": b'{"format": "cachecd-manifest", oops'}, "meta"),
    "15-byte digest": ({"arrays_fn": lambda a: a.update(exp_xxh3=a["exp_xxh3"][:, :15])}, "xxh3"),
    "overlapping ranges": ({"arrays_fn": _overlap}, "range"),
    "range past the file": ({"arrays_fn": _past_end}, "range"),
    'revision "main"': ({"meta_fn": lambda m: m.update(revision="main")}, "revision"),
}


@pytest.fixture(scope="module")
def setup(small: Model, module_pool):  # type: ignore[no-untyped-def]
    hub = module_pool.hub(small)
    return hub, module_pool.daemon(hub, [small])


@pytest.mark.parametrize("case", list(BAD))
def test_registration_refuses_naming_file_and_field(small: Model, setup, case: str) -> None:  # type: ignore[no-untyped-def]
    _, d = setup
    kwargs, field = BAD[case]
    path = new_dir("cdm") / "bad.manifest"
    path.write_bytes(_rewrite(small, **kwargs))
    with d.client() as c:
        with pytest.raises(ManifestInvalid) as info:
            c.register(path)
        assert str(path) in info.value.message and field in info.value.message, info.value.message
        assert info.value.http_status == 422
        fetch_verified(c, small, small.layers[0], [case.__len__() % 32])  # others still served
    FIGURES.add("s14.bad_manifests_refused")
    key = "".join(ch if ch.isalnum() else "_" for ch in case)
    FIGURES.set(f"s14.message_{key}", info.value.message.replace(str(path), "FILE")[:90])


def test_bad_manifest_at_start_refuses_that_model_only(small: Model, big: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    bad = new_dir("cdm") / "main.manifest"
    bad.write_bytes(_rewrite(big, meta_fn=lambda m: m.update(revision="main")))
    d = pool.daemon(hub, [small], args=["--manifest", str(bad)])
    with d.client() as c:
        refused = c.stats()["refused_models"]
        fetch_verified(c, small, small.layers[1], [0])
        c.register(big.manifest_path)  # a good big, stored by the daemon
        assert big.repo in {m["repo"] for m in c.models()}
    assert any(str(bad) in why for why in refused.values()), refused
    FIGURES.set("s14.manifests_refused_at_start_daemon_serving", len(refused))
    # The stored copy of big rots between runs: big is refused at start, small still served.
    assert d.stop() == 0
    stored = next((d.base / "models" / "manifests").glob("faults--big--*.manifest"))
    stored.write_bytes(stored.read_bytes()[:1000])
    d.start()
    with d.client() as c:
        fetch_verified(c, small, small.layers[1], [1])
        with pytest.raises(RepoNotAllowed) as info:
            c.experts(big.repo, big.layers[0], [0])
        assert "refused" in info.value.message and str(stored) in info.value.message
    FIGURES.set("s14.rotted_stored_manifest",
                f"{info.value.http_status} {info.value.code} after a restart; "
                f"{small.repo} served")

