"""Upstream under FakeHub's fault knobs (RELIABILITY.md #2-#5): wrong bytes never reach
on_verified, bad ranges and cut bodies are retried a bounded number of times, stalls time out,
and no request goes out before the server said so."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from cachecd import errors
from cachecd.upstream.fetch import Upstream
from tests.fakes.fake_hub import (
    FakeHub,
    FakeManifest,
    Faults,
    expert_bytes_of,
    hub_upstream,
    write_expert_shards,
)
from tests.fakes.fault_proxy import FaultProxy
from tests.unit.test_hub import Sink, keys, layer, run


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, FakeManifest]:
    folder = tmp_path_factory.mktemp("faults")
    return folder, write_expert_shards(folder, expert_bytes=200 * 1024)


def test_flipped_byte_every_time_bounded_refetch_then_mismatch(
    repo: tuple[Path, FakeManifest],
) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.flip_byte = True
        sink = Sink()
        wanted = layer(m, 0)[:3]
        failures = await up.fetch_experts(m, wanted, sink)
        assert sink.got == {}  # never handed a bad byte
        assert set(failures) == keys(wanted)
        assert all(isinstance(f, errors.ChecksumMismatch) for f in failures.values())
        assert hub.count("cdn_get") == 3 * (1 + 2)  # each: first fetch + 2 refetches
        assert up.stats()["faults_checksum"] == 9

    run(*repo, scenario, checksum_refetches=2, coalesce_max_experts=1)


def test_flipped_byte_in_a_coalesced_request_refetches_only_that_expert(
    repo: tuple[Path, FakeManifest],
) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.flip_byte, hub.faults.times = True, 1
        sink = Sink()
        wanted = layer(m, 0)[:3]
        assert await up.fetch_experts(m, wanted, sink) == {}
        for e in wanted:
            assert sink.got[(e.layer, e.expert)] == expert_bytes_of(folder, e)
        ranges = [r.range for r in hub.records if r.kind == "cdn_get"]
        mid = wanted[1].ranges[0]  # the flipped byte sits in the middle of the body
        assert ranges[1:] == [f"bytes={mid.start}-{mid.end - 1}"]
        assert up.stats()["checksum_refetches"] == 1

    run(*repo, scenario)


@pytest.mark.parametrize(
    ("knob", "fault"),
    [
        ({"ignore_range": True}, "faults_ignored_range"),
        ({"wrong_content_range": True}, "faults_content_range"),
        ({"pad_body": 10}, "faults_content_length"),
        ({"short_body": 10}, "faults_content_length"),
    ],
)
def test_bad_range_answers_are_rejected(
    repo: tuple[Path, FakeManifest], knob: dict[str, Any], fault: str
) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        for k, v in knob.items():
            setattr(hub.faults, k, v)
        sink = Sink()
        failures = await up.fetch_experts(m, layer(m, 0)[:2], sink)
        assert sink.got == {}
        assert {type(f) for f in failures.values()} == {errors.BadUpstreamRange}
        assert hub.count("cdn_get") == 2  # max_retries=1: two attempts, then the error
        assert up.stats()[fault] == 2 and up.stats().get("bytes", 0) == 0

    run(*repo, scenario, max_retries=1)


def test_bad_range_once_then_good_succeeds(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.ignore_range, hub.faults.times = True, 1
        sink = Sink()
        assert await up.fetch_experts(m, layer(m, 1)[:2], sink) == {}
        assert [r.status for r in hub.records if r.kind == "cdn_get"] == [200, 206]

    run(*repo, scenario)


@pytest.mark.parametrize("knob", ["truncate_after", "reset_after"])
def test_cut_body_transient_is_retried(repo: tuple[Path, FakeManifest], knob: str) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        setattr(hub.faults, knob, 70_000)
        hub.faults.times = 2
        sink = Sink()
        wanted = layer(m, 0)[:2]
        assert await up.fetch_experts(m, wanted, sink) == {}
        for e in wanted:
            assert sink.got[(e.layer, e.expert)] == expert_bytes_of(folder, e)
        assert hub.count("cdn_get") == 3 and up.stats()["retries"] == 2

    run(*repo, scenario)


@pytest.mark.parametrize("knob", ["truncate_after", "reset_after"])
def test_cut_body_persistent_fails_bounded(repo: tuple[Path, FakeManifest], knob: str) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        setattr(hub.faults, knob, 1000)
        sink = Sink()
        failures = await up.fetch_experts(m, layer(m, 0)[:1], sink)
        assert sink.got == {} and len(failures) == 1
        assert {type(f) for f in failures.values()} <= {
            errors.UpstreamError,
            errors.BadUpstreamRange,
        }
        assert hub.count("cdn_get") == 3  # max_retries=2

    run(*repo, scenario, max_retries=2)


def test_stall_times_out_and_counts_attempts(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.stall_after = 1000
        failures = await up.fetch_experts(m, layer(m, 0)[:1], Sink())
        (err,) = failures.values()
        assert isinstance(err, errors.UpstreamTimeout) and err.retryable
        assert hub.count("cdn_get") == 2 and up.stats()["faults_timeout"] == 2

    run(*repo, scenario, read_timeout=0.3, max_retries=1)


def test_total_deadline_stops_a_slow_dribble(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.stall_after = 1000  # stalls longer than the deadline, shorter reads never fire
        with pytest.raises(errors.UpstreamTimeout):
            await up.fetch_range(m, next(iter(m.files)), 0, 100_000)
        assert hub.count("cdn_get") == 1  # no retry once the deadline has passed

    run(*repo, scenario, read_timeout=30, total_timeout=0.5, max_retries=5)


def test_deadline_passing_while_a_retry_waits_its_turn_reports_the_fault(
    repo: tuple[Path, FakeManifest],
) -> None:
    """Three requests share one stream; every answer ignores the Range after 0.3 s. The first
    request's retry gets the stream only after the other two requests end (the third by an
    answer at 0.9 s or by its own deadline, which is later than the first's), so past its 0.85 s
    deadline: it fails with what the upstream did (a bad range), not with the wait."""

    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.ignore_range, hub.faults.delay = True, 0.3
        file = next(iter(m.files))
        first = asyncio.create_task(up.fetch_range(m, file, 0, 10))
        await asyncio.sleep(0.05)  # the first request takes the stream before the others
        others = [asyncio.create_task(up.fetch_range(m, file, 10 * i, 10 * i + 10)) for i in (1, 2)]
        done = await asyncio.gather(first, *others, return_exceptions=True)
        assert isinstance(done[0], errors.BadUpstreamRange), done[0]
        assert up.stats()["faults_ignored_range"] >= 2  # the first and the second answer

    run(*repo, scenario, total_timeout=0.85, max_retries=5)


def test_429_retry_after_is_honoured(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.status_script, hub.faults.retry_after = [429], "2"
        sink = Sink()
        wanted = layer(m, 0)[:3]  # three requests; the first gets the 429
        assert await up.fetch_experts(m, wanted, sink) == {}
        cdn = [r for r in hub.records if r.kind == "cdn_get"]
        assert [r.status for r in cdn] == [429, 206, 206, 206]
        later = [r.t for r in hub.records if r.t > cdn[0].t]
        assert (
            min(later) - cdn[0].t >= 2.0
        )  # no request to that host within 2 s, not only the retry
        assert len(sink.got) == 3

    run(*repo, scenario, max_parallel=1, coalesce_max_experts=1)


def test_ratelimit_header_is_honoured(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.status_script, hub.faults.ratelimit = [429], '"api";r=0;t=1'
        assert await up.fetch_experts(m, layer(m, 0)[:1], Sink()) == {}
        t = hub.times("cdn_get")
        assert len(t) == 2 and t[1] - t[0] >= 1.0

    run(*repo, scenario)


def test_retry_after_beyond_deadline_fails_fast_as_rate_limited(
    repo: tuple[Path, FakeManifest],
) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.status_script, hub.faults.retry_after = [429], "3600"
        with pytest.raises(errors.UpstreamRateLimited, match="request_id"):
            await up.fetch_range(m, next(iter(m.files)), 0, 10)
        assert hub.count("cdn_get") == 1

    run(*repo, scenario, total_timeout=5)


def test_503_storm_backs_off_and_stays_within_parallel_limit(
    repo: tuple[Path, FakeManifest],
) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.status_script = [503, 0, 503, 0, 0, 503, 0, 0, 0, 503] * 2
        sink = Sink()
        assert await up.fetch_experts(m, list(m.entries.values()), sink) == {}
        assert len(sink.got) == len(m.entries)
        assert hub.peak_in_flight <= 2 and up.stats()["faults_status_503"] >= 4
        assert up.stats()["retries"] == up.stats()["faults_status_503"]

    run(*repo, scenario, max_parallel=2, coalesce_max_experts=1, max_retries=6)


def test_persistent_503_gives_upstream_error(repo: tuple[Path, FakeManifest]) -> None:
    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.status_script = [503] * 10
        with pytest.raises(errors.UpstreamError, match="HTTP 503"):
            await up.fetch_range(m, next(iter(m.files)), 0, 10)
        assert hub.count("cdn_get") == 4

    run(*repo, scenario, max_retries=3)


# -- through FaultProxy: faults below HTTP --------------------------------------------------------


def via_proxy(folder: Path, m: FakeManifest, toxics: dict[str, Any], check: Any, **kw: Any) -> None:
    """Fetch layer 0 with the CDN behind a FaultProxy (resolve goes straight to FakeHub, so the
    proxy's connections are exactly the range GETs)."""

    async def main() -> None:
        async with FakeHub(folder, m.repo, m.revision) as hub:
            port = int(hub.url.rsplit(":", 1)[1])
            async with FaultProxy("127.0.0.1", port) as proxy:
                hub.public_url = proxy.url
                for k, v in toxics.items():
                    setattr(proxy.toxics, k, v)
                opts = {"backoff_base": 0.01, "backoff_cap": 0.05, "max_parallel": 1, **kw}
                up = hub_upstream(hub.url, None, **opts)
                sink = Sink()
                try:
                    failures = await up.fetch_experts(m, layer(m, 0), sink)
                finally:
                    await up.close()
                await check(hub, proxy, up, sink, failures)

    asyncio.run(main())


def test_proxy_latency_slicer_bandwidth_still_exact(repo: tuple[Path, FakeManifest]) -> None:
    folder, m = repo

    async def check(
        hub: FakeHub, proxy: FaultProxy, up: Upstream, sink: Sink, failures: Any
    ) -> None:
        assert failures == {}
        for e in layer(m, 0):
            assert sink.got[(e.layer, e.expert)] == expert_bytes_of(folder, e)
        assert hub.count("cdn_get") == 1 and up.stats().get("retries", 0) == 0

    toxics = {"latency": 0.01, "slicer": 7000, "bandwidth": 40 << 20}
    via_proxy(folder, m, toxics, check)


@pytest.mark.parametrize("toxic", ["limit_data", "reset_peer"])
def test_proxy_cut_connection_is_retried(repo: tuple[Path, FakeManifest], toxic: str) -> None:
    folder, m = repo

    async def check(
        hub: FakeHub, proxy: FaultProxy, up: Upstream, sink: Sink, failures: Any
    ) -> None:
        assert failures == {} and proxy.toxic_hits >= 1
        for e in layer(m, 0):
            assert sink.got[(e.layer, e.expert)] == expert_bytes_of(folder, e)
        assert up.stats()["retries"] >= 1 and hub.count("cdn_get") >= 2

    # Only the first connection is cut, inside the body: the retry opens a clean one.
    via_proxy(folder, m, {toxic: 100_000, "connections": 1}, check)


def test_proxy_stall_gives_upstream_timeout(repo: tuple[Path, FakeManifest]) -> None:
    folder, m = repo

    async def check(
        hub: FakeHub, proxy: FaultProxy, up: Upstream, sink: Sink, failures: Any
    ) -> None:
        assert sink.got == {}
        assert {type(f) for f in failures.values()} == {errors.UpstreamTimeout}
        assert up.stats()["faults_timeout"] == 2  # two attempts, no more
        assert hub.count("cdn_get") == 2 and proxy.accepted == 2

    via_proxy(folder, m, {"timeout": 0}, check, read_timeout=0.3, max_retries=1)


def test_same_length_bytes_of_another_revision_are_rejected(
    repo: tuple[Path, FakeManifest], tmp_path: Path
) -> None:
    other = tmp_path / "other"
    write_expert_shards(other, expert_bytes=200 * 1024, seed=99)  # same sizes, other bytes

    async def scenario(hub: FakeHub, up: Upstream, m: FakeManifest, folder: Path) -> None:
        hub.faults.serve_from = other
        sink = Sink()
        failures = await up.fetch_experts(m, layer(m, 1)[:2], sink)
        assert sink.got == {} and set(failures) == keys(layer(m, 1)[:2])
        assert all(isinstance(f, errors.ChecksumMismatch) for f in failures.values())

    run(*repo, scenario, checksum_refetches=1)


def test_fds_and_tasks_return_to_baseline_after_faults(repo: tuple[Path, FakeManifest]) -> None:
    folder, m = repo

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def main() -> None:
        async with FakeHub(folder, m.repo, m.revision) as hub:
            await asyncio.sleep(0)
            fd0, tasks0 = fds(), len(asyncio.all_tasks())
            up = hub_upstream(hub.url, None, backoff_base=0.01, backoff_cap=0.02, read_timeout=0.2)
            for knob in ("truncate_after", "reset_after", "stall_after"):
                hub.faults = Faults(**{knob: 5000}, times=3)
                await up.fetch_experts(m, list(m.entries.values()), Sink())
            assert up.stats()["retries"] >= 3
            await up.close()
            for _ in range(50):  # transports close on the next loop turns
                if fds() <= fd0 and len(asyncio.all_tasks()) <= tasks0:
                    break
                await asyncio.sleep(0.02)
            assert fds() <= fd0 and len(asyncio.all_tasks()) <= tasks0

    asyncio.run(main())
