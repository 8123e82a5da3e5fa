"""The Hub's source reading through Xet (``upstream.xet_source``) against XetFakeHub over real HTTP
on 127.0.0.1: exact bytes proven against the file's hash, each tamper refused, each expiry
recovered. The daemon-level tests are tests/faults/test_s18_xet.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from cachecd import errors
from cachecd.upstream.fetch import Upstream
from cachecd.upstream.hub_client import HubClient
from cachecd.upstream.xet_source import XetSource
from tests.fakes.fake_hub import FakeManifest, expert_bytes_of, write_expert_shards
from tests.fakes.fake_xet import XetFakeHub

Scenario = Callable[[XetFakeHub, Upstream, FakeManifest, Path], Awaitable[None]]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, FakeManifest]:
    folder = tmp_path_factory.mktemp("xethub")
    return folder, write_expert_shards(folder, layers=2, experts=4, expert_bytes=40 * 1024)


def run(repo: tuple[Path, FakeManifest], scenario: Scenario, **faults: Any) -> None:
    folder, manifest = repo

    async def main() -> None:
        async with XetFakeHub(folder, manifest.repo, manifest.revision) as hub:
            for k, v in faults.items():
                setattr(hub.xet_faults, k, v)
            hub_client = HubClient(hub.url, False, backoff_base=0.01, backoff_cap=0.05)
            up = Upstream(XetSource(hub_client, backoff_base=0.01, backoff_cap=0.05),
                          coalesce_max_experts=1)
            try:
                await scenario(hub, up, manifest, folder)
            finally:
                await up.close()

    asyncio.run(main())


class Sink:
    def __init__(self) -> None:
        self.got: dict[tuple[int, int], bytes] = {}

    async def __call__(self, entry: Any, data: Any) -> None:
        self.got[(entry.layer, entry.expert)] = bytes(data)


def test_every_expert_read_through_xet_and_proven(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: XetFakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        sink = Sink()
        entries = list(m.entries.values())
        assert await up.fetch_experts(m, entries, sink) == {}
        for e in entries:
            assert sink.got[(e.layer, e.expert)] == expert_bytes_of(folder, e)
        assert hub.count("cdn_get") == 0  # no byte came the LFS way
        assert hub.count("xet_proof") == hub.count("xet_reconstruction") >= len(entries)
        assert hub.count("xet_token") == 1 and hub.count("resolve_head") == len(m.files)
        stats = up.stats()
        assert stats["xet_windows"] >= len(entries) and stats["xet_proof_bytes"] > 0
        assert up.source.routes() == {f"{m.repo}@{m.revision}": "xet"}  # type: ignore[attr-defined]
        assert any(r.headers.get("Content-Type", "") == "" for r in hub.records)  # recorded

    run(repo, scenario)


REFUSED = ("xet_proof_mismatch", "xet_invalid")


# A flipped byte in a compressed chunk fails to decode (xet_invalid), in a stored one it fails
# the proof (xet_proof_mismatch): either way it is refused.
@pytest.mark.parametrize(("fault", "codes"), [
    ("flip_xorb_byte", REFUSED),
    ("bad_chunk_header", ("xet_invalid",)),
    ("proof_node", ("xet_proof_mismatch",)),
    ("proof_offset", ("xet_proof_mismatch",)),
    ("swap_terms", ("xet_proof_mismatch",)),
])
def test_a_tampered_answer_is_refused(repo: tuple[Path, FakeManifest], fault: str,
                                      codes: tuple[str, ...]) -> None:
    async def scenario(hub: XetFakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        sink = Sink()
        entries = [m.expert(0, 1), m.expert(1, 3)]
        failures = await up.fetch_experts(m, entries, sink)
        assert sink.got == {}  # nothing handed on
        assert set(failures) == {(0, 1), (1, 3)}
        assert all(f.code in codes for f in failures.values()), failures
        assert "nothing was stored or served" in str(failures[(0, 1)]).lower()

    run(repo, scenario, **{fault: True})


def test_an_expired_signed_url_asks_for_the_reconstruction_again(
        repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: XetFakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        sink = Sink()
        e = m.expert(0, 2)
        assert await up.fetch_experts(m, [e], sink) == {}
        assert sink.got[(0, 2)] == expert_bytes_of(folder, e)
        statuses = [r.status for r in hub.records if r.kind == "xet_xorb"]
        assert statuses[0] == 403 and statuses[-1] == 206
        assert hub.count("xet_reconstruction") == 2 and up.stats()["xet_urls_expired"] == 1

    run(repo, scenario, expire_urls=1)


def test_a_token_expiring_mid_read_is_renewed(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: XetFakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        sink = Sink()
        e = m.expert(1, 0)
        assert await up.fetch_experts(m, [e], sink) == {}
        assert sink.got[(1, 0)] == expert_bytes_of(folder, e)
        recon = [r.status for r in hub.records if r.kind == "xet_reconstruction"]
        assert recon == [401, 200] and hub.count("xet_token") == 2

    run(repo, scenario, expire_tokens_after_proof=1)


def test_a_short_lived_token_is_renewed_before_it_expires(
        repo: tuple[Path, FakeManifest]) -> None:
    """A token with less than its margin left is not used: the next read asks for a new one
    first (here every token arrives at its exp, which the store does not yet enforce), and no
    request is refused."""

    async def scenario(hub: XetFakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        sink = Sink()
        hub.xet_faults.token_ttl, hub.xet_faults.token_grace = 0.0, 3600.0
        assert await up.fetch_experts(m, [m.expert(0, 0)], sink) == {}
        assert await up.fetch_experts(m, [m.expert(0, 3)], sink) == {}
        # Each content store request went with a token asked for just before it.
        assert hub.count("xet_token") == hub.count("xet_proof") + hub.count("xet_reconstruction")
        assert all(r.status != 401 for r in hub.records)

    run(repo, scenario)


def test_a_429_waits_as_the_content_store_says(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: XetFakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        sink = Sink()
        e = m.expert(0, 0)
        assert await up.fetch_experts(m, [e], sink) == {}
        assert sink.got[(0, 0)] == expert_bytes_of(folder, e)
        proofs = [r for r in hub.records if r.kind == "xet_proof"]
        assert [r.status for r in proofs] == [429, 200]
        assert proofs[1].t - proofs[0].t >= 1.0  # Retry-After: 1, not the 10 ms backoff
        assert up.stats()["faults_xet_status_429"] == 1

    run(repo, scenario, status_script=[429], retry_after="1")


def test_v1_where_v2_is_absent(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: XetFakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        sink = Sink()
        for e in (m.expert(1, 1), m.expert(0, 2)):
            assert await up.fetch_experts(m, [e], sink) == {}
            assert sink.got[(e.layer, e.expert)] == expert_bytes_of(folder, e)
        paths = [r.path.split("/")[1] for r in hub.records if r.kind == "xet_reconstruction"]
        assert paths == ["v2", "v1", "v1"]  # v2 asked once

    run(repo, scenario, no_v2=True)


def test_a_wrong_manifest_is_named_not_refetched(repo: tuple[Path, FakeManifest]) -> None:
    """Proven bytes that disagree with the manifest's xxh3: the manifest is wrong, and asking
    again cannot help."""

    async def scenario(hub: XetFakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        from dataclasses import replace

        e = replace(m.expert(0, 3), xxh3=bytes(16))
        failures = await up.fetch_experts(m, [e], Sink())
        assert failures[(0, 3)].code == "manifest_mismatch"
        assert "proven" in failures[(0, 3)].message
        assert hub.count("xet_reconstruction") == 1  # not fetched again

    run(repo, scenario)


def test_a_file_without_a_xet_hash_takes_the_lfs_route(repo: tuple[Path, FakeManifest]) -> None:
    folder, manifest = repo

    async def main() -> None:
        from tests.fakes.fake_hub import FakeHub

        async with FakeHub(folder, manifest.repo, manifest.revision) as hub:
            up = Upstream(XetSource(HubClient(hub.url, False)))
            try:
                sink = Sink()
                e = manifest.expert(0, 0)
                assert await up.fetch_experts(manifest, [e], sink) == {}
                assert sink.got[(0, 0)] == expert_bytes_of(folder, e)
                assert hub.count("cdn_get") == 1
                assert up.source.routes() == {  # type: ignore[attr-defined]
                    f"{manifest.repo}@{manifest.revision}": "lfs"}
            finally:
                await up.close()

    asyncio.run(main())


def test_errors_are_typed() -> None:
    assert errors.XetProofError.http_status == 502
