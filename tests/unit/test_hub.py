"""Upstream against FakeHub over real HTTP on 127.0.0.1: exactness, coalescing, auth, statuses."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from cachecd import errors
from cachecd.upstream.fetch import Upstream
from tests.fakes.fake_hub import (
    FakeHub,
    FakeManifest,
    expert_bytes_of,
    hub_upstream,
    write_expert_shards,
)

TOKEN = "hf_" + "Zq7" * 12  # shaped like a real token, so a leak matches RELIABILITY #16's grep

Scenario = Callable[[FakeHub, Upstream, FakeManifest, Path], Awaitable[None]]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, FakeManifest]:
    folder = tmp_path_factory.mktemp("hub")
    return folder, write_expert_shards(folder)


def run(
    folder: Path, manifest: FakeManifest, scenario: Scenario, token: str | None = None, **kw: Any
) -> None:
    """Run ``scenario`` against a fresh FakeHub and Upstream: fast backoff, and one stream unless
    overridden, so request counts are exactly the coalescing plan."""

    async def main() -> None:
        async with FakeHub(folder, manifest.repo, manifest.revision) as hub:
            opts = {"backoff_base": 0.01, "backoff_cap": 0.05, "max_parallel": 1, **kw}
            up = hub_upstream(hub.url, token, **opts)
            try:
                await scenario(hub, up, manifest, folder)
            finally:
                await up.close()

    asyncio.run(main())


class Sink:
    """An on_verified that keeps a copy of what it was handed."""

    def __init__(self) -> None:
        self.got: dict[tuple[int, int], bytes] = {}

    async def __call__(self, entry: Any, data: memoryview) -> None:
        self.got[(entry.layer, entry.expert)] = bytes(data)


def layer(manifest: FakeManifest, n: int) -> list[Any]:
    return [e for k, e in sorted(manifest.entries.items()) if k[0] == n]


def keys(entries: list[Any]) -> set[tuple[int, int]]:
    return {(e.layer, e.expert) for e in entries}


def test_layer_fetched_exactly_in_one_coalesced_request(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        sink = Sink()
        wanted = layer(m, 0)
        assert await up.fetch_experts(m, wanted, sink) == {}
        assert hub.count("cdn_get") == 1 and hub.count("resolve_head") == 1
        for e in wanted:
            assert sink.got[(e.layer, e.expert)] == expert_bytes_of(folder, e)
        span = wanted[-1].ranges[0].end - wanted[0].ranges[0].start
        assert (
            hub.records[-1].range
            == f"bytes={wanted[0].ranges[0].start}-{wanted[0].ranges[0].start + span - 1}"
        )
        assert up.stats()["bytes"] == span

    run(*repo, scenario)


def test_coalescing_respects_max_experts_and_gap(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        sink = Sink()
        wanted = layer(m, 0)  # six neighbours
        assert await up.fetch_experts(m, wanted, sink) == {}
        assert hub.count("cdn_get") == 3  # max 2 experts per request
        hub.clear_records()
        spaced = wanted[::2]  # gaps of one expert (~48 KiB) > max_gap
        assert await up.fetch_experts(m, spaced, sink) == {}
        assert hub.count("cdn_get") == 3
        assert len(sink.got) == 6

    run(*repo, scenario, coalesce_max_experts=2, coalesce_max_gap=1024)


def test_small_batch_is_spread_over_max_parallel_streams(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        sink = Sink()
        wanted = layer(m, 0)  # six neighbours, three streams: two experts per request
        assert await up.fetch_experts(m, wanted, sink) == {}
        assert sorted(r.range for r in hub.records if r.kind == "cdn_get") == sorted(
            f"bytes={a.ranges[0].start}-{b.ranges[0].end - 1}"
            for a, b in zip(wanted[::2], wanted[1::2], strict=True)
        )
        assert len(sink.got) == 6

    run(*repo, scenario, max_parallel=3)


def test_split_expert_is_assembled_in_order(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        split = [e for e in m.entries.values() if len(e.ranges) == 2]
        assert len(split) == 1 and split[0].ranges[0].file != split[0].ranges[1].file
        sink = Sink()
        assert await up.fetch_experts(m, split, sink) == {}
        e = split[0]
        assert sink.got[(e.layer, e.expert)] == expert_bytes_of(folder, e)
        assert hub.count("cdn_get") == 2 and hub.count("resolve_head") == 2  # one per shard

    run(*repo, scenario)


def test_resolve_once_per_file_across_many_fetches(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        entries = list(m.entries.values())
        sink = Sink()
        await asyncio.gather(*(up.fetch_experts(m, [e], sink) for e in entries * 3))
        for e in entries[:4]:
            assert await up.fetch_experts(m, [e], sink) == {}
        assert hub.count("resolve_head") == len(m.files) == 2
        assert up.stats()["resolves"] == 2
        assert hub.count("cdn_get") >= len(entries)
        assert len(sink.got) == len(entries)

    run(*repo, scenario)


def test_token_reaches_resolve_only_and_never_a_log(
    repo: tuple[Path, FakeManifest], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)

    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.require_token = TOKEN
        hub.faults.status_script = [503]
        assert await up.fetch_experts(m, layer(m, 0), Sink()) == {}
        resolve = [r for r in hub.records if r.kind == "resolve_head"]
        cdn = [r for r in hub.records if r.kind == "cdn_get"]
        assert resolve and all(r.headers.get("Authorization") == f"Bearer {TOKEN}" for r in resolve)
        assert len(cdn) == 2 and all("Authorization" not in r.headers for r in cdn)
        assert all(r.headers.get("Accept-Encoding") == "identity" for r in cdn)

    run(*repo, scenario, token=TOKEN)
    assert "upstream retry" in caplog.text  # the 503 was logged...
    assert not re.search(r"hf_[A-Za-z0-9]{30,}", caplog.text)  # ...without the token


def test_wrong_token_is_unauthorized_and_not_retried(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.require_token = "hf_the_right_one"
        failures = await up.fetch_experts(m, layer(m, 0)[:2], Sink())
        assert set(failures) == keys(layer(m, 0)[:2])
        assert {type(e) for e in failures.values()} == {errors.Unauthorized}
        assert hub.count("resolve_head") == 1 and hub.count("cdn_get") == 0
        msg = next(iter(failures.values())).message
        assert "request_id=Root=fake-" in msg and "fake hub says 401" in msg
        assert TOKEN not in msg

    run(*repo, scenario, token=TOKEN)


def test_an_explicit_token_wins_over_the_one_huggingface_hub_finds(
    repo: tuple[Path, FakeManifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_" + "Env" * 12)

    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.require_token = TOKEN
        assert await up.fetch_experts(m, layer(m, 0), Sink()) == {}
        heads = [r.headers.get("Authorization") for r in hub.records if r.kind == "resolve_head"]
        assert heads and set(heads) == {f"Bearer {TOKEN}"}

    run(*repo, scenario, token=TOKEN)


def test_a_token_replaced_after_start_is_found_again_after_a_401(
    repo: tuple[Path, FakeManifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mirror that serves the bytes itself keeps the resolved location, so a range GET is the
    first to meet a rotated token: the 401 makes the upstream ask huggingface_hub again and
    resolve once more with the new token, within the same fetch."""
    old, new = "hf_" + "Old" * 12, "hf_" + "New" * 12
    monkeypatch.setenv("HF_TOKEN", old)

    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.direct, hub.faults.require_token = True, old
        first, second = layer(m, 0)[0], layer(m, 0)[-1]
        assert first.ranges[0].file == second.ranges[0].file  # one location, resolved once
        assert await up.fetch_experts(m, [first], Sink()) == {}
        hub.faults.require_token = new  # the old token is revoked...
        monkeypatch.setenv("HF_TOKEN", new)  # ...and the new one is what huggingface_hub finds
        sink = Sink()
        assert await up.fetch_experts(m, [second], sink) == {}
        assert sink.got[(second.layer, second.expert)] == expert_bytes_of(folder, second)
        gets = [(r.status, r.headers.get("Authorization")) for r in hub.records
                if r.kind == "resolve_get"]
        assert gets == [(206, f"Bearer {old}"), (401, f"Bearer {old}"), (206, f"Bearer {new}")]

    run(*repo, scenario, token=None)


@pytest.mark.parametrize(("status", "exc"), [(403, errors.Gated), (404, errors.NotFound)])
def test_gated_and_not_found_are_not_retried(
    repo: tuple[Path, FakeManifest], status: int, exc: type[errors.CachecdError]
) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.resolve_status_script = [status]
        with pytest.raises(exc, match="request_id=Root=fake-"):
            await up.fetch_range(m, next(iter(m.files)), 0, 10)
        assert hub.count("resolve_head") == 1 and hub.count("cdn_get") == 0

    run(*repo, scenario)


def test_missing_file_is_not_found(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        ghost = FakeManifest(m.repo, m.revision, {}, {})
        with pytest.raises(errors.NotFound):
            await up.fetch_range(ghost, "model-00009-of-00009.safetensors", 0, 10)
        assert hub.count() == 1

    run(*repo, scenario)


def test_a_file_whose_hub_sha256_disagrees_is_refused_at_resolve(
    repo: tuple[Path, FakeManifest],
) -> None:
    """The check on use where the registration could not ask the Hub: X-Linked-Etag against
    the manifest's sha256, before any byte of that file is fetched."""

    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        from dataclasses import replace

        name = next(iter(m.files))
        altered = FakeManifest(m.repo, m.revision, {**m.files, name: replace(
            m.files[name], sha256="ab" * 32)}, m.entries)
        with pytest.raises(errors.ManifestMismatch, match=f"resolve {name}: sha256 {'ab' * 32}"):
            await up.fetch_range(altered, name, 0, 10)
        assert hub.count("resolve_head") == 1 and hub.count("cdn_get") == 0
        assert await up.fetch_range(m, name, 0, 10) == (folder / name).read_bytes()[:10]

    run(*repo, scenario)


def test_resolve_5xx_is_retried(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.resolve_status_script = [500, 502]
        e = layer(m, 1)[0]
        assert await up.fetch_experts(m, [e], Sink()) == {}
        assert hub.count("resolve_head") == 3 and up.stats()["retries"] == 2

    run(*repo, scenario)


def test_fetch_range_is_exact(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        name, info = next(iter(m.files.items()))
        data = (folder / name).read_bytes()
        assert await up.fetch_range(m, name, 3, 70_001) == data[3:70_001]
        assert await up.fetch_range(m, name, info.size - 1, info.size) == data[-1:]
        with pytest.raises(errors.InvalidRequest):
            await up.fetch_range(m, name, 5, info.size + 1)
        assert hub.count("cdn_get") == 2

    run(*repo, scenario)


def test_offline_raises_before_any_request(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        with pytest.raises(errors.Offline, match="HF_HUB_OFFLINE"):
            await up.fetch_experts(m, layer(m, 0), Sink())
        with pytest.raises(errors.Offline):
            await up.fetch_range(m, next(iter(m.files)), 0, 1)
        assert hub.count() == 0

    run(*repo, scenario, offline=True)


def test_peak_in_flight_is_bounded(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.delay = 0.05
        sink = Sink()
        assert await up.fetch_experts(m, list(m.entries.values()), sink) == {}
        assert hub.count("cdn_get") >= 12
        assert hub.peak_in_flight == 3  # reached, never exceeded
        assert up.stats()["peak_in_flight"] == 3
        assert len(sink.got) == len(m.entries)

    run(*repo, scenario, max_parallel=3, coalesce_max_experts=1)


def test_cdn_403_resolves_again_once(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        e0, e1 = layer(m, 0)[:2]
        assert await up.fetch_experts(m, [e0], Sink()) == {}
        hub.invalidate_urls()  # the signed URL we cached is now refused
        sink = Sink()
        assert await up.fetch_experts(m, [e1], sink) == {}
        assert sink.got[(e1.layer, e1.expert)] == expert_bytes_of(folder, e1)
        assert hub.count("resolve_head") == 2
        assert [r.status for r in hub.records if r.kind == "cdn_get"] == [206, 403, 206]

    run(*repo, scenario)


def test_a_short_lived_signed_url_is_used_for_most_of_its_life(
    repo: tuple[Path, FakeManifest]
) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        # The URL says it expires in 30 s: less than the minute kept as margin on the Hub's hour,
        # so the margin is a tenth of its life, and it serves every fetch until then (resolving
        # again at each fetch would spend the Hub's /resolve limit for nothing).
        hub.url_ttl = 30
        for e in layer(m, 0)[:3]:
            assert await up.fetch_experts(m, [e], Sink()) == {}
        assert hub.count("resolve_head") == 1
        assert [r.status for r in hub.records if r.kind == "cdn_get"] == [206, 206, 206]

    run(*repo, scenario)


def test_on_verified_error_becomes_that_experts_error(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        wanted = layer(m, 0)[:3]
        bad = (wanted[1].layer, wanted[1].expert)
        sink = Sink()

        async def store(entry: Any, data: memoryview) -> None:
            if (entry.layer, entry.expert) == bad:
                raise errors.DiskFull("no space left")
            await sink(entry, data)

        failures = await up.fetch_experts(m, wanted, store)
        assert set(failures) == {bad} and isinstance(failures[bad], errors.DiskFull)
        assert set(sink.got) == keys(wanted) - {bad}

    run(*repo, scenario)
