"""A token holder's share of the door while strangers churn connections (issue 43).

A real daemon shares on 127.0.0.1 (``serve --share``, no model needed: a request for an unknown
digest is answered 200 with its size 0, which is all a peer's "served" needs here). ``--addresses``
strangers, each on its own loopback address (127.0.x.y), open connections to the share that never
send a whole request head, and open another as soon as one is closed, for ``--seconds``. Meanwhile
an authorised peer asks ``POST /v2/blobs`` once a second as ``upstream.peers`` does (an aiohttp
session with the token, ``--peer-deadline`` for connecting and the answer). Prints how many of its
tries were answered within the deadline, and the share's own door counters.

Every loop is bounded (``--seconds``); nothing leaves loopback.

    python bench/share_churn.py [--addresses 1000] [--seconds 15] [--peer-deadline 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time
from typing import Any

from _common import REPO_ROOT  # noqa: F401 - puts the repo on sys.path

from tests.harness import DaemonProcess, free_port, short_tmp


def _addresses(n: int) -> list[str]:
    return [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(n)]


async def _stranger(addr: str, port: int, until: float, counts: dict[str, int],
                    wrong_token: bool) -> None:
    """Connections from ``addr``, one after another: each holds a slot with half a request head
    until closed, or (``wrong_token``) sends a whole request with a wrong token."""
    while time.monotonic() < until:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, local_addr=(addr, 0)), 5)
        except (OSError, TimeoutError):
            counts["connect_failed"] += 1
            await asyncio.sleep(0.05)
            continue
        counts["connections"] += 1
        try:
            writer.write(b"POST /v2/blobs HTTP/1.1\r\nHost: x\r\n" + (
                b"Authorization: Bearer guess\r\nContent-Length: 0\r\n\r\n" if wrong_token else b""))
            await asyncio.wait_for(reader.read(1), max(0.01, until - time.monotonic()))
        except (OSError, TimeoutError):
            pass
        finally:
            writer.transport.abort()


async def _peer(url: str, token: str, deadline: float, until: float) -> list[float | None]:
    """One request a second as ``upstream.peers`` asks; each its answer time, or None."""
    import aiohttp

    out: list[float | None] = []
    timeout = aiohttp.ClientTimeout(total=deadline, sock_connect=deadline, sock_read=deadline)
    body = json.dumps([{"digest": "00" * 16, "source": "00" * 16}])
    async with aiohttp.ClientSession(trust_env=False) as session:
        while time.monotonic() + deadline < until:
            t0 = time.monotonic()
            try:
                async with session.post(f"{url}/v2/blobs", data=body, timeout=timeout,
                                        headers={"Authorization": f"Bearer {token}"}) as resp:
                    await resp.read()
                    out.append(time.monotonic() - t0 if resp.status == 200 else None)
            except (aiohttp.ClientError, TimeoutError, OSError):
                out.append(None)
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
    return out


async def _flood(port: int, n: int, per_address: int, until: float,
                 wrong_token: bool) -> dict[str, int]:
    counts = {"connections": 0, "connect_failed": 0}
    await asyncio.gather(*(_stranger(a, port, until, counts, wrong_token)
                           for a in _addresses(n) for _ in range(per_address)))
    return counts


def _flood_process(port: int, n: int, per_address: int, seconds: float, wrong_token: bool,
                   out: Any) -> None:
    """The strangers in a process of their own: their loop never starves the peer's."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    out.put(asyncio.run(_flood(port, n, per_address, time.monotonic() + seconds, wrong_token)))


def churn(port: int, token: str, n: int, seconds: float, deadline: float,
          per_address: int, wrong_token: bool) -> dict[str, Any]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    flood = ctx.Process(target=_flood_process,
                        args=(port, n, per_address, seconds, wrong_token, out))
    flood.start()
    time.sleep(2.0)  # the flood first
    tries = asyncio.run(_peer(f"http://127.0.0.1:{port}", token, deadline,
                              time.monotonic() + seconds - 2.0))
    counts = out.get(timeout=seconds + 60)
    flood.join(timeout=30)
    served = [t for t in tries if t is not None]
    return {"tries": len(tries), "served": len(served),
            "worst_s": round(max(served), 3) if served else None, **counts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--addresses", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--peer-deadline", type=float, default=2.0)
    p.add_argument("--per-address", type=int, default=2, help="connections each stranger keeps")
    p.add_argument("--wrong-token", action="store_true",
                   help="strangers send whole requests with a wrong token (default: half heads)")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    base = short_tmp("cdchurn")
    token = os.urandom(32).hex()
    (base / "token").write_text(token)
    (base / "token").chmod(0o600)
    port = free_port()
    d = DaemonProcess("http://127.0.0.1:9", [], args=[
        "--share", f"127.0.0.1:{port}", "--share-token-file", str(base / "token")]).start()
    try:
        got = churn(port, token, args.addresses, args.seconds, args.peer_deadline,
                    args.per_address, args.wrong_token)
        with d.client() as c:
            share = c.stats()["share"]
    finally:
        d.cleanup()
    door = {k: v for k, v in share.items() if k.startswith(("connections", "refused"))}
    print(f"addresses={args.addresses} per_address={args.per_address} seconds={args.seconds} "
          f"stranger_connections="
          f"{got['connections']} connect_failed={got['connect_failed']}")
    print(f"door {door}")
    print(f"authorised peer served {got['served']} of {got['tries']} tries within "
          f"{args.peer_deadline}s (worst {got['worst_s']}s)")
    print(f"ratio={got['served'] / max(1, got['tries']):.3f}")


if __name__ == "__main__":
    main()
