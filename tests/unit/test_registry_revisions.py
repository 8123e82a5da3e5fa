"""The registry's names for several revisions of one repo: ``ORG/NAME@REV`` picks one, a bare name
only while one is registered, a removal takes only the one named, and a record from before
revisions were keys (keyed ``ORG/NAME``) is served, then re-keyed when registered again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cachecd.daemon.registry import Registry
from cachecd.errors import InvalidRequest, RepoNotAllowed
from cachecd.manifest.build import build_manifest
from cachecd.manifest.source import LocalSource
from cachecd.store.store import Store

REPO = "acme/tiny"
OLD, NEW = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    from cachecd.testbed.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("regrev")
    write_tiny_model(root / "m")
    out = {}
    for rev in (OLD, NEW):
        build_manifest(LocalSource(root / "m", REPO, rev), progress=False).save(root / rev)
        out[rev] = (root / rev).read_bytes()
    return out


def test_revisions_are_named_and_removed_one_at_a_time(manifests: dict[str, bytes],
                                                      tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path / "cache"])
        try:
            reg = Registry(store, tmp_path / "models")
            await reg.register(manifests[OLD], "old", None)
            assert reg.get(REPO).manifest.revision == OLD  # one revision: the bare name is it
            await reg.register(manifests[NEW], "new", None)
            assert [m.name for m in reg.all()] == [f"{REPO}@{OLD}", f"{REPO}@{NEW}"]
            assert reg.get(f"{REPO}@{NEW[:7]}").manifest.revision == NEW
            with pytest.raises(InvalidRequest, match=f"{REPO}@{OLD}, {REPO}@{NEW}"):
                reg.get(REPO)
            with pytest.raises(RepoNotAllowed, match="not registered at cccccccc"):
                reg.get(f"{REPO}@cccccccc")
            await reg.unregister(f"{REPO}@{OLD[:12]}")
            assert reg.get(REPO).manifest.revision == NEW
            assert [r["key"] for r in store.models()] == [f"{REPO}@{NEW}"]
            with pytest.raises(RepoNotAllowed, match="is not registered"):
                await reg.unregister(f"{REPO}@{OLD}")
        finally:
            store.close_sync()

    asyncio.run(go())


def test_a_record_keyed_by_repo_is_served_then_re_keyed(manifests: dict[str, bytes],
                                                        tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path / "cache"])
        try:
            path = tmp_path / "old.manifest"
            path.write_bytes(manifests[OLD])
            await asyncio.wrap_future(store.put_model(REPO, {
                "repo": REPO, "revision": OLD, "manifest": str(path), "local_dir": None}))
            reg = Registry(store, tmp_path / "models")
            await reg.load_registered()
            assert reg.get(f"{REPO}@{OLD}").record_key == REPO
            await reg.register(manifests[OLD], "again", None)
            assert [r["key"] for r in store.models()] == [f"{REPO}@{OLD}"]
            assert [m.name for m in reg.all()] == [f"{REPO}@{OLD}"]
        finally:
            store.close_sync()

    asyncio.run(go())


def test_a_revision_name_names_its_commit_moves_with_it_and_survives_a_restart(
        manifests: dict[str, bytes], tmp_path: Path) -> None:
    async def go() -> None:
        store = await Store.open([tmp_path / "cache"])
        try:
            reg = Registry(store, tmp_path / "models")
            await reg.register(manifests[OLD], "old", None, names=["main"])
            await reg.register(manifests[NEW], "new", None, names=["v2"])
            assert reg.get(f"{REPO}@main").manifest.revision == OLD
            assert reg.get(f"{REPO}@v2").manifest.revision == NEW
            await reg.register(manifests[NEW], "new", None, names=["main"])  # main moved on
            assert reg.get(f"{REPO}@main").manifest.revision == NEW
            assert reg.get(f"{REPO}@v2").manifest.revision == NEW
            with pytest.raises(InvalidRequest, match="names must be"):
                await reg.register(manifests[NEW], "new", None, names=["no/slash"])
            again = Registry(store, tmp_path / "models")  # a restart reads the records
            await again.load_registered()
            assert {m.manifest.revision: m.names for m in again.all()} == {
                OLD: (), NEW: ("main", "v2")}
        finally:
            store.close_sync()

    asyncio.run(go())
