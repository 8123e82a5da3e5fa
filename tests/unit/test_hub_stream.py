"""The streamed miss path: request planning for big experts, bytes written to blob temps while
they arrive, and every way a streamed expert can go wrong (real FakeHub over HTTP, real Store)."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from cachecd import errors
from cachecd.daemon.misses import MissFiller
from cachecd.store import blobs
from cachecd.store.store import Store
from cachecd.upstream.hub_plan import plan_requests
from tests.fakes.fake_hub import (
    FakeHub,
    FakeManifest,
    expert_bytes_of,
    hub_upstream,
    write_expert_shards,
)


class _R:
    def __init__(self, file: str, start: int, end: int) -> None:
        self.file, self.start, self.end = file, start, end


class _E:
    def __init__(self, i: int, start: int, end: int) -> None:
        self.layer, self.expert, self.nbytes, self.xxh3 = 0, i, end - start, b""
        self.ranges = (_R("a", start, end),)


def test_plan_gives_big_experts_a_request_each_and_merges_small_ones() -> None:
    big = [_E(i, i * 100, i * 100 + 100) for i in range(6)]
    reqs = plan_requests(big, max_bytes=10_000, max_experts=16, target_bytes=100)
    assert [len(r.experts()) for r in reqs] == [1] * 6
    small = [_E(i, i * 10, i * 10 + 10) for i in range(6)]
    merged = plan_requests(small, max_bytes=10_000, max_experts=16, target_bytes=30)
    assert [len(r.experts()) for r in merged] == [3, 3]  # 30 bytes reached: next request


class _Model:
    def __init__(self, manifest: FakeManifest) -> None:
        self.manifest, self.repo = manifest, manifest.repo


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, FakeManifest]:
    folder = tmp_path_factory.mktemp("hub")
    return folder, write_expert_shards(folder, expert_bytes=3 << 20, experts=4)


def fetch(
    folder: Path, m: FakeManifest, faults: dict[str, Any], **kw: Any
) -> tuple[dict[str, bytes], dict[str, int], list[str], BaseException | None]:
    """Fetch layer 0 (single-range experts) cold through a MissFiller; the blobs' bytes, the
    upstream's counters, what is left in tmp/, and the error if the fetch failed."""
    cache = tempfile.mkdtemp(prefix="cd", dir="/tmp")

    async def main() -> tuple[dict[str, bytes], dict[str, int], list[str], BaseException | None]:
        async with FakeHub(folder, m.repo, m.revision) as hub:
            for k, v in faults.items():
                setattr(hub.faults, k, v)
            opts = {"backoff_base": 0.01, "backoff_cap": 0.05, "max_parallel": 2, **kw}
            up = hub_upstream(hub.url, None, **opts)
            store = await Store.open([Path(cache)])
            err: BaseException | None = None
            try:
                wanted = [e for k, e in sorted(m.entries.items()) if k[0] == 0]
                filler = MissFiller(store, up)
                try:
                    await filler.ensure(_Model(m), wanted)  # type: ignore[arg-type]
                except errors.CachecdError as exc:
                    err = exc
                await filler.settled()  # answered once verified; the commits finish after
                got = {}
                for e in wanted:
                    if store.has(e.digest_hex):
                        fd, _ = store.open_blob(e.digest_hex)
                        with os.fdopen(fd, "rb") as f:
                            got[e.digest_hex] = f.read()
                return got, up.stats(), os.listdir(Path(cache) / "tmp"), err
            finally:
                await store.close()
                await up.close()

    try:
        return asyncio.run(main())
    finally:
        import shutil

        shutil.rmtree(cache, ignore_errors=True)


def expected(folder: Path, m: FakeManifest) -> dict[str, bytes]:
    return {
        e.digest_hex: expert_bytes_of(folder, e) for k, e in sorted(m.entries.items()) if k[0] == 0
    }


@pytest.mark.parametrize("target,requests", [(2 << 20, 4), (4 << 20, 2)])
def test_streamed_experts_land_byte_exact(
    repo: tuple[Path, FakeManifest], target: int, requests: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    real, written = blobs.BlobWriter.writev, []

    def counted(self: blobs.BlobWriter, offset: int, views: list[memoryview]) -> None:
        written.append(sum(len(v) for v in views))
        real(self, offset, views)

    monkeypatch.setattr(blobs.BlobWriter, "writev", counted)
    got, stats, left, err = fetch(*repo, {}, coalesce_target_bytes=target)
    assert sum(written) == sum(len(b) for b in got.values())  # streamed, not written whole
    assert err is None and left == []
    assert got == expected(*repo)
    # 3 MiB experts: one request each past a 2 MiB target, two a request under 4 MiB
    assert stats["requests_range"] == requests
    assert stats.get("checksum_refetches", 0) == 0


def test_a_wrong_streamed_expert_is_fetched_again(repo: tuple[Path, FakeManifest]) -> None:
    got, stats, left, err = fetch(*repo, {"flip_byte": True, "times": 1})
    assert err is None and left == []
    assert got == expected(*repo)
    assert stats["faults_checksum"] == 1 and stats["checksum_refetches"] == 1


def test_a_stream_cut_short_starts_over(repo: tuple[Path, FakeManifest]) -> None:
    got, stats, left, err = fetch(*repo, {"truncate_after": (3 << 20) - 5000, "times": 2})
    assert err is None and left == []
    assert got == expected(*repo)  # the file holds one attempt's bytes, not a mix
    assert stats["retries"] >= 2


def test_always_wrong_bytes_fail_and_leave_no_temp(repo: tuple[Path, FakeManifest]) -> None:
    got, stats, left, err = fetch(
        *repo, {"flip_byte": True}, checksum_refetches=1, coalesce_target_bytes=1
    )
    assert isinstance(err, errors.ChecksumMismatch)
    assert got == {} and left == []


def test_a_failed_write_falls_back_to_verified_bytes(
    repo: tuple[Path, FakeManifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = blobs.BlobWriter.writev
    calls = {"n": 0}

    def flaky(self: blobs.BlobWriter, offset: int, views: list[memoryview]) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(5, "Input/output error")
        real(self, offset, views)

    monkeypatch.setattr(blobs.BlobWriter, "writev", flaky)
    got, stats, left, err = fetch(*repo, {})
    assert err is None and left == []
    assert got == expected(*repo)
    assert calls["n"] > 2
