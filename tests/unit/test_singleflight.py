"""SingleFlight: one execution per key, shared outcome, shielded work, forgotten when done."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from cachecd import errors
from cachecd.upstream.singleflight import SingleFlight
from tests.fakes.fake_hub import FakeHub, expert_bytes_of, hub_upstream, write_expert_shards


def test_64_callers_one_execution_same_result() -> None:
    async def main() -> None:
        sf: SingleFlight[str, bytearray] = SingleFlight()
        runs = 0

        async def work() -> bytearray:
            nonlocal runs
            runs += 1
            await asyncio.sleep(0.05)
            return bytearray(b"expert")

        results = await asyncio.gather(*(sf.do("k", work) for _ in range(64)))
        assert runs == 1 and sf.executions == 1
        assert all(r is results[0] for r in results)
        assert len(sf) == 0

    asyncio.run(main())


def test_failure_is_shared_then_forgotten() -> None:
    async def main() -> None:
        sf: SingleFlight[str, int] = SingleFlight()
        runs = 0

        async def failing() -> int:
            nonlocal runs
            runs += 1
            await asyncio.sleep(0.02)
            raise errors.UpstreamTimeout("stalled")

        outs = await asyncio.gather(
            *(sf.do("k", failing) for _ in range(64)), return_exceptions=True
        )
        assert runs == 1
        assert all(isinstance(o, errors.UpstreamTimeout) and o is outs[0] for o in outs)
        assert not sf.in_flight("k")

        async def ok() -> int:
            return 7

        assert await sf.do("k", ok) == 7  # the next call runs again

    asyncio.run(main())


def test_cancelled_caller_does_not_cancel_the_work() -> None:
    async def main() -> None:
        sf: SingleFlight[str, str] = SingleFlight()
        finished = asyncio.Event()

        async def work() -> str:
            await asyncio.sleep(0.05)
            finished.set()
            return "done"

        first = asyncio.ensure_future(sf.do("k", work))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(sf.do("k", work))
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await second == "done"
        assert finished.is_set() and sf.executions == 1

        # Every waiter gone: the work still completes, and its failure is not "never retrieved".
        async def fails() -> str:
            await asyncio.sleep(0.02)
            finished.set()
            raise errors.Internal("boom")

        finished.clear()
        lone = asyncio.ensure_future(sf.do("j", fails))
        await asyncio.sleep(0)
        lone.cancel()
        await sf.wait_idle()
        assert finished.is_set() and not sf.in_flight("j")

    asyncio.run(main())


def test_do_many_runs_missing_keys_once_and_joins_in_flight() -> None:
    async def main() -> None:
        sf: SingleFlight[int, str] = SingleFlight()
        batches: list[list[int]] = []

        async def fetch(keys: list[int]) -> dict[int, str | BaseException]:
            batches.append(keys)
            await asyncio.sleep(0.03)
            out: dict[int, str | BaseException] = {k: f"v{k}" for k in keys if k != 3}
            out[3] = errors.ChecksumMismatch("bad") if 3 in keys else out.get(3, "")
            return {k: v for k, v in out.items() if k in keys and k != 4}

        a = asyncio.ensure_future(sf.do_many([1, 2, 3], fetch))
        await asyncio.sleep(0)
        b = asyncio.ensure_future(sf.do_many([2, 3, 4, 5], fetch))
        ra, rb = await a, await b
        assert batches == [[1, 2, 3], [4, 5]]
        assert ra[1] == "v1" and ra[2] == "v2" and isinstance(ra[3], errors.ChecksumMismatch)
        assert rb[2] == "v2" and rb[3] is ra[3] and rb[5] == "v5"
        assert isinstance(rb[4], errors.Internal)  # the batch forgot key 4
        assert len(sf) == 0

    asyncio.run(main())


def test_do_many_batch_exception_reaches_every_key() -> None:
    async def main() -> None:
        sf: SingleFlight[int, str] = SingleFlight()

        async def broken(keys: list[int]) -> dict[int, str | BaseException]:
            raise errors.Offline("offline")

        out = await sf.do_many([1, 2, 2], broken)
        assert list(out) == [1, 2] and out[1] is out[2]
        assert isinstance(out[1], errors.Offline)

    asyncio.run(main())


def test_cancel_all_releases_waiters() -> None:
    async def main() -> None:
        sf: SingleFlight[str, str] = SingleFlight()

        async def forever() -> str:
            await asyncio.sleep(3600)
            return ""

        waiter = asyncio.ensure_future(sf.do("k", forever))
        await asyncio.sleep(0.01)
        sf.cancel_all()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await sf.wait_idle()
        assert len(sf) == 0

    asyncio.run(main())


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("sf")
    return folder, write_expert_shards(folder, layers=1, experts=2)


def test_64_callers_through_upstream_one_hub_request(repo: tuple[Path, Any]) -> None:
    """RELIABILITY #6: FakeHub delay 500 ms, 64 callers, the first disconnects: count == 1."""
    folder, manifest = repo
    entry = manifest.expert(0, 0)  # (0, 1) is the split one

    async def main() -> None:
        async with FakeHub(folder, manifest.repo, manifest.revision) as hub:
            hub.faults.delay = 0.5
            up = hub_upstream(hub.url, None)
            sf: SingleFlight[str, bytes] = SingleFlight()

            async def fetch() -> bytes:
                got: list[bytes] = []

                async def keep(e: Any, data: memoryview) -> None:
                    got.append(bytes(data))

                failures = await up.fetch_experts(manifest, [entry], keep)
                if failures:
                    raise failures[(0, 0)]
                return got[0]

            try:
                callers = [asyncio.ensure_future(sf.do(entry.digest_hex, fetch)) for _ in range(64)]
                await asyncio.sleep(0.1)
                callers[0].cancel()  # the first client disconnects
                outs = await asyncio.gather(*callers[1:])
                assert hub.count("cdn_get") == 1 and sf.executions == 1
                assert all(o == expert_bytes_of(folder, entry) for o in outs)

                hub.faults.status_script = [404]  # now every caller shares one failure
                fails = await asyncio.gather(
                    *(sf.do(entry.digest_hex, fetch) for _ in range(64)), return_exceptions=True
                )
                assert all(isinstance(f, errors.NotFound) and f is fails[0] for f in fails)
                assert hub.count("cdn_get") == 2
                assert len(await sf.do(entry.digest_hex, fetch)) == entry.nbytes  # fetches again
                assert hub.count("cdn_get") == 3
            finally:
                await up.close()

    asyncio.run(main())
