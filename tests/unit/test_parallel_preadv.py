"""parallel_preadv over real files: pieces, grouping into jobs, the inline path."""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from cachecd_client import transport


def _files(tmp_path: Path, sizes: list[int]) -> tuple[list[int], list[bytes]]:
    fds, datas = [], []
    for i, n in enumerate(sizes):
        data = random.Random(i).randbytes(n)
        p = tmp_path / f"b{i}"
        p.write_bytes(data)
        fds.append(os.open(p, os.O_RDONLY))
        datas.append(data)
    return fds, datas


@pytest.mark.parametrize("chunk,min_job", [(4 << 20, 256 << 10), (1000, 1), (4096, 10_000)])
def test_landed_sees_each_window_filled_in_order(tmp_path: Path, monkeypatch, chunk: int, min_job: int) -> None:  # type: ignore[no-untyped-def]
    """``landed(i, n)`` comes on the caller's thread, in order, for each out as its windows are
    read (``n`` growing, the last at its size), and only when its first n bytes are in place
    (a GPU copy started there reads them at once): an out bigger than a job lands in parts."""
    import threading

    monkeypatch.setattr(transport, "_CHUNK", chunk)
    monkeypatch.setattr(transport, "_MIN_JOB", min_job)
    sizes = [5 << 20, 1, 300_000, 0, 6528, 3 << 20]
    fds, datas = _files(tmp_path, sizes)
    bufs = [np.zeros(n, np.uint8) for n in sizes]
    seen: list[tuple[int, int]] = []

    def landed(i: int, n: int) -> None:
        assert threading.current_thread() is threading.main_thread()
        assert bufs[i][:n].tobytes() == datas[i][:n], f"out {i} short of {n} bytes at landed"
        seen.append((i, n))

    try:
        with ThreadPoolExecutor(3) as pool:
            transport.parallel_preadv(pool, fds, sizes, [memoryview(b) for b in bufs], landed)
    finally:
        for fd in fds:
            os.close(fd)
    assert [i for i, _ in seen] == sorted(i for i, _ in seen)  # in order
    for i, size in enumerate(sizes):
        ns = [n for j, n in seen if j == i]
        assert ns and ns == sorted(set(ns)) and ns[-1] == size, (i, ns)
    if min_job < sizes[0] and chunk < sizes[0]:  # the first out spans several jobs
        assert len([n for j, n in seen if j == 0]) > 1, seen


def test_an_error_waits_for_every_read_under_way(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """When one window fails, the others still running finish before the error is raised: the
    caller frees the outs (slots) on the error, and no read may write into them afterwards."""
    import threading
    import time

    monkeypatch.setattr(transport, "_CHUNK", 1000)
    monkeypatch.setattr(transport, "_MIN_JOB", 1)
    fds, _ = _files(tmp_path, [3000, 3000])
    running = 0
    lock = threading.Lock()
    real = transport._read_piece

    def slow_then_fail(fd: int, views: list[memoryview], offset: int) -> None:
        nonlocal running
        with lock:
            running += 1
        try:
            if fd == fds[0] and offset == 0:
                raise OSError("the first window fails at once")
            time.sleep(0.05)
            real(fd, views, offset)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(transport, "_read_piece", slow_then_fail)
    try:
        with ThreadPoolExecutor(3) as pool:
            with pytest.raises(OSError, match="fails at once"):
                transport.parallel_preadv(pool, fds, [3000, 3000],
                                          [memoryview(bytearray(3000)) for _ in fds])
            assert running == 0
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("chunk,min_job", [(4 << 20, 256 << 10), (1000, 1), (4096, 10_000)])
def test_digests_check_every_out_as_its_windows_land(tmp_path: Path, monkeypatch, chunk: int, min_job: int) -> None:  # type: ignore[no-untyped-def]
    """With ``digests``, each out is hashed on the reader threads as its windows land, in file
    order even when a later window lands first (the first window of out 0 is held back), and
    the outs whose bytes differ from their digest are returned; the others are not."""
    import threading
    import time

    import xxhash

    monkeypatch.setattr(transport, "_CHUNK", chunk)
    monkeypatch.setattr(transport, "_MIN_JOB", min_job)
    sizes = [5 << 20, 1, 300_000, 0, 6528, 3 << 20]
    fds, datas = _files(tmp_path, sizes)
    digests = [xxhash.xxh3_128(d).digest() for d in datas]
    rotten = [2, 5]  # a byte flipped on disk after the digest was taken
    for i in rotten:
        path = tmp_path / f"b{i}"
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        path.write_bytes(bytes(raw))
    hashers: set[str] = set()
    real_read, real_landed = transport._read_piece, transport._Check.landed

    def late_first(fd: int, views: list[memoryview], offset: int) -> None:
        if fd == fds[0] and offset == 0:
            time.sleep(0.05)  # out 0's later windows land before its first
        real_read(fd, views, offset)

    def seen(self, start: int, end: int, views: list[memoryview]) -> None:  # type: ignore[no-untyped-def]
        hashers.add(threading.current_thread().name)
        real_landed(self, start, end, views)

    monkeypatch.setattr(transport, "_read_piece", late_first)
    monkeypatch.setattr(transport._Check, "landed", seen)
    bufs = [np.zeros(n, np.uint8) for n in sizes]
    seen: list[tuple[int, int]] = []
    try:
        with ThreadPoolExecutor(3, thread_name_prefix="reader") as pool:
            bad = transport.parallel_preadv(pool, fds, sizes, [memoryview(b) for b in bufs],
                                            lambda i, n: seen.append((i, n)), digests)
            unchecked = transport.parallel_preadv(pool, fds, sizes,
                                                  [memoryview(b) for b in bufs])
    finally:
        for fd in fds:
            os.close(fd)
    assert bad == rotten
    assert unchecked == []  # no digests: nothing checked
    for i, size in enumerate(sizes):  # each out still lands in order, to its size
        ns = [n for j, n in seen if j == i]
        assert ns and ns == sorted(set(ns)) and ns[-1] == size, (i, ns)
    for i in set(range(len(sizes))) - set(rotten):
        assert bufs[i].tobytes() == datas[i]
    if len(bufs[0]) > min_job:  # several jobs: the hashing ran on the readers, not the caller
        assert hashers and all(name.startswith("reader") for name in hashers), hashers
