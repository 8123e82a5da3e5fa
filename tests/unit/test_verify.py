"""verify: xxh3-128 digests, exact-length and digest checks, large buffers hashed off the loop."""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass

import pytest
import xxhash

from cachecd import errors
from cachecd.upstream import verify


@dataclass(frozen=True)
class Entry:
    layer: int
    expert: int
    nbytes: int
    xxh3: bytes


def entry_for(data: bytes) -> Entry:
    return Entry(3, 17, len(data), xxhash.xxh3_128(data).digest())


def test_digest_matches_xxh3_128_for_every_buffer_type() -> None:
    data = os.urandom(1000)
    want = xxhash.xxh3_128(data).digest()
    assert len(want) == verify.DIGEST_LEN
    for buf in (data, bytearray(data), memoryview(data)):
        assert verify.digest(buf) == want
        assert verify.digest_hex(buf) == want.hex()
    assert verify.digest(memoryview(b"x" + data)[1:]) == want  # a slice of a bigger buffer


def test_verify_accepts_exact_bytes_and_rejects_any_change() -> None:
    data = bytearray(os.urandom(4096))
    entry = entry_for(bytes(data))
    verify.verify(entry, data)
    data[2048] ^= 1
    with pytest.raises(errors.ChecksumMismatch, match="layer=3 expert=17"):
        verify.verify(entry, data)
    with pytest.raises(errors.ChecksumMismatch, match="4095 bytes"):
        verify.verify(entry, data[:-1])


def test_verify_async_small_and_large() -> None:
    small = os.urandom(100)
    large = os.urandom(verify.OFFLOAD_MIN_BYTES + 1)

    async def main() -> None:
        await verify.verify_async(entry_for(small), small)
        await verify.verify_async(entry_for(large), memoryview(large))
        bad = bytearray(large)
        bad[-1] ^= 0xFF
        with pytest.raises(errors.ChecksumMismatch):
            await verify.verify_async(entry_for(large), bad)

    asyncio.run(main())


def test_large_buffers_are_hashed_off_the_event_loop() -> None:
    seen: list[str] = []
    real = verify.digest

    def spy(buf: verify.Buffer) -> bytes:
        seen.append(threading.current_thread().name)
        return real(buf)

    async def main() -> None:
        loop_thread = threading.current_thread().name
        verify.digest = spy  # type: ignore[assignment]
        try:
            await verify.digest_async(b"small")
            await verify.digest_async(bytes(verify.OFFLOAD_MIN_BYTES))
        finally:
            verify.digest = real  # type: ignore[assignment]
        assert seen[0] == loop_thread and seen[1] != loop_thread

    asyncio.run(main())
