"""Scenario 14: bad manifests. Bad meta JSON, a 15-byte digest, overlapping ranges, a range past
its file and revision "main" each fail with manifest_invalid naming the file and the field;
that model is refused (at registration, at start, or when its stored copy rots between runs)
and the other models are still served."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachecd.errors import ManifestInvalid, ManifestUnchecked, RepoNotAllowed
from tests.faults.figures import FIGURES
from tests.faults.support import FaultDaemon, Model, fetch_verified, new_dir
from tests.harness import HubProcess, run_cli


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
    "JSON nested 100,000 deep": ({"raw_meta": b"[" * 100_000 + b"]" * 100_000}, "meta"),
    "a shape past int64": ({"meta_fn": lambda m: m["shapes"][0].append(10**30)}, "shapes[0]"),
    "a dtype that is a list": ({"meta_fn": lambda m: m["dtypes"].__setitem__(0, ["U8"])},
                               "dtypes[0]"),
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



# -- hostile input: nesting and expansion (issue 38, item 4) ------------------------------------
DEEP = 100_000


def _deep_header_copy(model: Model, root: Path, repo: str) -> Path:
    """A copy of ``model``'s checkpoint as ``repo`` whose biggest shard's safetensors header is
    JSON nested thousands deep, padded to the same length (so every range stays where it was)."""
    folder = root / repo
    shutil.copytree(model.folder, folder)
    shard = max(folder.glob("*.safetensors"), key=lambda p: int.from_bytes(p.read_bytes()[:8], "little"))
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    depth = (n - 8) // 2
    data[8:8 + n] = (b'{"a":' + b"[" * depth + b"]" * depth + b"}").ljust(n)
    shard.write_bytes(bytes(data))
    return shard


def _manifest_for(model: Model, commit: str, repo: str, shard: Path | None, out: Path) -> Path:
    """``model``'s manifest as ``repo`` at ``commit``, with ``shard``'s sha256 if given."""
    def meta_fn(meta: dict[str, Any]) -> None:
        meta.update(repo=repo, revision=commit)
        for f in meta["files"]:
            if shard is not None and f[0] == shard.name:
                f[2] = hashlib.sha256(shard.read_bytes()).hexdigest()
    out.write_bytes(_rewrite(model, meta_fn=meta_fn))
    return out


def test_nested_json_at_start_refuses_that_model_only(small: Model) -> None:
    """`serve --manifest` with a meta nested 100,000 deep (refused in one line naming the file
    and the field) and with a manifest whose shard's safetensors header, from the endpoint, is
    nested thousands deep (that model's experts are refused, ``manifest_unchecked``, naming the
    shard: the endpoint's bytes are not a header); the daemon starts and serves its good model."""
    from huggingface_hub import HfApi

    root = new_dir("cdn")
    shutil.copytree(small.folder, root / "s14" / "good")
    shard = _deep_header_copy(small, root, "s14/nested")
    hub = HubProcess(root)
    d: FaultDaemon | None = None
    try:
        api = HfApi(endpoint=hub.url)
        commits = {r: api.model_info(r).sha or "" for r in ("s14/good", "s14/nested")}
        good = _manifest_for(small, commits["s14/good"], "s14/good", None, root / "good.manifest")
        header = _manifest_for(small, commits["s14/nested"], "s14/nested", shard,
                               root / "header.manifest")
        deep_meta = root / "meta.manifest"
        deep_meta.write_bytes(_rewrite(small, raw_meta=b"[" * DEEP + b"]" * DEEP))
        d = FaultDaemon(hub.url, [], args=[
            "--manifest", str(good), "--manifest", str(header), "--manifest", str(deep_meta)])
        d.start()
        with d.client() as c:
            refused = c.stats()["refused_models"]
            entry = small.entry(small.layers[0], 1)
            got = c.experts("s14/good", entry.layer, [entry.expert])[0]
            assert got.tobytes() == small.bytes_of(entry)
            with pytest.raises(ManifestUnchecked) as unchecked:  # the endpoint's header is bad
                c.experts("s14/nested", entry.layer, [entry.expert])
            assert c.health()["ok"]
    finally:
        if d is not None:
            d.stop()
        hub.stop()
    assert set(refused) == {str(deep_meta)}, refused
    why = refused[str(deep_meta)]
    assert "meta: JSON nested" in why and "\n" not in why, why
    why = unchecked.value.message
    assert shard.name in why and "JSON nested" in why and "\n" not in why, why
    FIGURES.set("s14.nested_json_refused_at_start", len(refused))


def _peak_rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) << 10  # type: ignore[index]


def test_zip_bomb_is_refused_before_it_expands(small: Model, setup) -> None:  # type: ignore[no-untyped-def]
    """A 0.5 MB manifest whose one column inflates to 512 MiB: refused as manifest_invalid naming the
    column, and the daemon's peak memory grows by far less than the column."""
    _, d = setup
    column = 512 << 20
    bomb = new_dir("cdm") / "bomb.manifest"
    bomb.write_bytes(_rewrite(small, arrays_fn=lambda a: a.update(
        t_offset=np.zeros(column // 8, np.int64))))
    assert bomb.stat().st_size < 2 << 20
    assert d.proc is not None
    before = _peak_rss(d.proc.pid)
    with d.client() as c:
        with pytest.raises(ManifestInvalid) as info:
            c.register(bomb)
        fetch_verified(c, small, small.layers[0], [3])
    grew = _peak_rss(d.proc.pid) - before
    assert str(bomb) in info.value.message and "t_offset" in info.value.message, info.value.message
    assert grew < column // 8, f"peak memory grew {grew >> 20} MiB for a refused manifest"
    FIGURES.set("s14.zip_bomb_peak_growth_mib", grew >> 20)


def test_manifest_verify_says_one_line_for_a_nested_meta(small: Model) -> None:
    """`cachecd manifest verify FILE`, as a user runs it, on a meta nested 100,000 deep."""
    path = new_dir("cdm") / "deep.manifest"
    path.write_bytes(_rewrite(small, raw_meta=b"[" * DEEP + b"]" * DEEP))
    proc = run_cli("manifest", "verify", str(path), "--no-hub", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("cachecd: ")]
    assert lines == [f"cachecd: manifest_invalid: {path}: meta: JSON nested {DEEP} deep, over "
                     f"the limit of 32"], proc.stderr[-2000:]
