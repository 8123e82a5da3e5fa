"""MissFiller.settled: reports wait for commits under way, not for a stalled group's download."""

from __future__ import annotations

import asyncio

from cachecd.daemon.misses import MissFiller


def test_settled_waits_for_commits_but_not_for_a_stalled_download() -> None:
    async def main() -> None:
        f = MissFiller(None, None)  # type: ignore[arg-type] - settled() touches neither
        stalled = asyncio.Event()
        queued = asyncio.create_task(stalled.wait())  # a commit still waiting for its group
        f._commits.add(queued)
        await f.settled(download_wait=0.05)
        assert not queued.done()  # returned without it

        committing = asyncio.create_task(asyncio.sleep(0.05))  # a commit under way
        f._commits.add(committing)
        f._commits_started.add(committing)
        await f.settled(download_wait=0.0)
        assert committing.done()  # waited for it, although the queued one is still there

        stalled.set()
        await queued

    asyncio.run(main())
