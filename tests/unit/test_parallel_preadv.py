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
def test_every_byte_lands_in_its_buffer(tmp_path: Path, monkeypatch, chunk: int, min_job: int) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(transport, "_CHUNK", chunk)
    monkeypatch.setattr(transport, "_MIN_JOB", min_job)
    sizes = [0, 1, 999, 1000, 1001, 6528, 300_000, 5 << 20]
    fds, datas = _files(tmp_path, sizes)
    bufs = [np.zeros(n + 3, np.uint8) for n in sizes]
    try:
        with ThreadPoolExecutor(3) as pool:
            transport.parallel_preadv(pool, fds, sizes, [memoryview(b) for b in bufs])
    finally:
        for fd in fds:
            os.close(fd)
    for buf, data in zip(bufs, datas, strict=True):
        assert buf[: len(data)].tobytes() == data and not buf[len(data):].any()


def test_small_batches_are_read_in_the_callers_thread(tmp_path: Path) -> None:
    sizes = [6528] * 16  # one K3 token's worth of tiny experts: under one job
    fds, datas = _files(tmp_path, sizes)
    pool = ThreadPoolExecutor(2)
    pool.shutdown()  # a submit would raise: the reads must not need the pool
    bufs = [np.zeros(n, np.uint8) for n in sizes]
    try:
        transport.parallel_preadv(pool, fds, sizes, [memoryview(b) for b in bufs])
        with pytest.raises(RuntimeError):  # and a big batch does use it
            big = [transport._MIN_JOB] * 2
            transport.parallel_preadv(pool, fds[:2], big, [memoryview(bytearray(n)) for n in big])
    finally:
        for fd in fds:
            os.close(fd)
    assert [b.tobytes() for b in bufs] == datas


def test_a_short_file_is_an_error(tmp_path: Path) -> None:
    fds, _ = _files(tmp_path, [100])
    try:
        with ThreadPoolExecutor(2) as pool, pytest.raises(EOFError):
            transport.parallel_preadv(pool, fds, [200], [memoryview(bytearray(200))])
    finally:
        os.close(fds[0])


@pytest.mark.parametrize("chunk", [4 << 20, 1000, 333])
def test_lists_of_buffers_fill_in_order(tmp_path: Path, monkeypatch, chunk: int) -> None:  # type: ignore[no-untyped-def]
    """An out that is a list of buffers (one expert into several stack arrays): the bytes fill
    them one after another, windows spanning several buffers, and nothing past the size."""
    monkeypatch.setattr(transport, "_CHUNK", chunk)
    monkeypatch.setattr(transport, "_MIN_JOB", 1)
    parts = [[7, 1000, 1, 2048], [4096], [1, 1, 1, 997], [5 << 20, 300]]
    sizes = [sum(p) for p in parts]
    fds, datas = _files(tmp_path, sizes)
    stacks = [[np.zeros(n, np.uint8) for n in p] for p in parts]
    stacks[-1][-1] = np.zeros(310, np.uint8)  # a last buffer with room to spare stays zero past it
    try:
        with ThreadPoolExecutor(3) as pool:
            transport.parallel_preadv(
                pool, fds, sizes, [[memoryview(b) for b in bufs] for bufs in stacks]
            )
    finally:
        for fd in fds:
            os.close(fd)
    for bufs, data in zip(stacks, datas, strict=True):
        got = b"".join(b.tobytes() for b in bufs)
        assert got[: len(data)] == data and not any(got[len(data):])


def test_buffers_too_small_for_the_file_are_refused(tmp_path: Path) -> None:
    fds, _ = _files(tmp_path, [100])
    try:
        with ThreadPoolExecutor(2) as pool, pytest.raises(ValueError, match="hold 90"):
            transport.parallel_preadv(pool, fds, [100], [[memoryview(bytearray(90))]])
    finally:
        os.close(fds[0])


@pytest.mark.parametrize("chunk,min_job", [(4 << 20, 256 << 10), (1000, 1), (4096, 10_000)])
def test_done_sees_each_out_filled_in_order(tmp_path: Path, monkeypatch, chunk: int, min_job: int) -> None:  # type: ignore[no-untyped-def]
    """``done(i)`` comes once per out, in order, on the caller's thread, and only when out i
    holds all its bytes (a GPU copy started there reads them at once)."""
    import threading

    monkeypatch.setattr(transport, "_CHUNK", chunk)
    monkeypatch.setattr(transport, "_MIN_JOB", min_job)
    sizes = [5 << 20, 1, 300_000, 0, 6528, 3 << 20]
    fds, datas = _files(tmp_path, sizes)
    bufs = [np.zeros(n, np.uint8) for n in sizes]
    seen: list[int] = []

    def done(i: int) -> None:
        assert threading.current_thread() is threading.main_thread()
        assert bufs[i].tobytes() == datas[i], f"out {i} not filled when done({i}) came"
        seen.append(i)

    try:
        with ThreadPoolExecutor(3) as pool:
            transport.parallel_preadv(pool, fds, sizes, [memoryview(b) for b in bufs], done)
    finally:
        for fd in fds:
            os.close(fd)
    assert seen == list(range(len(sizes)))


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
