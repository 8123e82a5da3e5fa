"""Blob files and the cache dir lock: real files in temp dirs."""

from __future__ import annotations

import errno
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from cachecd import errors
from cachecd.store.blobs import BlobDirs, CacheDir, DirLock, hash_fd, validate_digest


def test_layout_created_private(tmp_path: Path) -> None:
    d = CacheDir(tmp_path / "c", 0)
    for sub in ("blobs", "tmp", "quarantine"):
        assert stat.S_IMODE((d.root / sub).stat().st_mode) == 0o700
    if sys.platform == "darwin":
        assert (d.root / ".metadata_never_index").exists()
    else:
        assert not (d.root / ".metadata_never_index").exists()


def test_write_and_read_blob(tmp_path: Path) -> None:
    blobs = BlobDirs([tmp_path])
    data = os.urandom(100_000)
    digest = xxhash.xxh3_128(data).hexdigest()
    assert blobs.write_blob(digest, memoryview(data)) == 0
    path = tmp_path / "blobs" / digest[:2] / digest
    assert path.read_bytes() == data
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert list((tmp_path / "tmp").iterdir()) == []
    fd, size = blobs.open_read(0, digest)
    try:
        assert size == len(data) and hash_fd(fd) == (digest, len(data))
    finally:
        os.close(fd)
    assert blobs.unlink(0, digest) and not blobs.unlink(0, digest)
    with pytest.raises(FileNotFoundError):
        blobs.open_read(0, digest)
    blobs.release()


_VALID = re.compile(r"[0-9a-f]{32}")


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=64), st.binary(max_size=40), st.integers(), st.none()))
def test_anything_but_32_lowercase_hex_is_invalid(value: object) -> None:
    if isinstance(value, str) and _VALID.fullmatch(value):
        assert validate_digest(value) == value
    else:
        with pytest.raises(errors.InvalidRequest):
            validate_digest(value)


@pytest.mark.parametrize(
    "bad", ["../" + "0" * 29, "0" * 31 + "\0", "/etc/passwd", "A" * 32, "0" * 32 + "\n", "%2e" * 11]
)
def test_traversal_rejected_before_io(tmp_path: Path, bad: str) -> None:
    blobs = BlobDirs([tmp_path])
    with pytest.raises(errors.InvalidRequest):
        blobs.write_blob(bad, b"x")
    with pytest.raises(errors.InvalidRequest):
        blobs.open_read(0, bad)
    assert list((tmp_path / "tmp").iterdir()) == []
    blobs.release()


def test_symlink_at_blob_path_is_not_followed(tmp_path: Path) -> None:
    blobs = BlobDirs([tmp_path])
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    digest = "ab" + "0" * 30
    (tmp_path / "blobs" / "ab").mkdir()
    (tmp_path / "blobs" / "ab" / digest).symlink_to(secret)
    with pytest.raises(OSError) as info:
        blobs.open_read(0, digest)
    assert info.value.errno == errno.ELOOP
    blobs.write_blob(digest, b"real bytes")  # the rename replaces the link, not its target
    assert secret.read_bytes() == b"not yours"
    assert not (tmp_path / "blobs" / "ab" / digest).is_symlink()
    blobs.release()


def test_quarantine_and_clear_tmp(tmp_path: Path) -> None:
    blobs = BlobDirs([tmp_path])
    digest = xxhash.xxh3_128(b"q").hexdigest()
    blobs.write_blob(digest, b"q")
    dest = blobs.quarantine(0, digest, "test")
    assert dest is not None and dest.parent == tmp_path / "quarantine"
    assert blobs.quarantine(0, digest, "again") is None
    (tmp_path / "tmp" / "left.over").write_bytes(b"x")
    assert blobs.dirs[0].clear_tmp() == 1
    blobs.release()


def test_lock_in_process_and_names_the_holder(tmp_path: Path) -> None:
    first = DirLock(tmp_path)
    with pytest.raises(errors.CacheLocked, match=f"pid {os.getpid()}") as info:
        DirLock(tmp_path)
    assert info.value.http_status == 409
    first.release()
    DirLock(tmp_path).release()


def test_lock_held_by_another_process(tmp_path: Path) -> None:
    code = (
        "import sys, time; from pathlib import Path; from cachecd.store.blobs import BlobDirs; "
        "b = BlobDirs([Path(sys.argv[1])]); print('locked', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        with pytest.raises(errors.CacheLocked, match=f"pid {proc.pid}"):
            BlobDirs([tmp_path])
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while True:  # the kernel drops the flock when the holder dies
        try:
            BlobDirs([tmp_path]).release()
            break
        except errors.CacheLocked:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_lock_all_or_nothing_across_dirs(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    held = DirLock(tmp_path / "b")
    with pytest.raises(errors.CacheLocked):
        BlobDirs([tmp_path / "a", tmp_path / "b"])
    DirLock(tmp_path / "a").release()  # the first dir's lock was given back
    held.release()


def test_new_blobs_spread_over_dirs(tmp_path: Path) -> None:
    blobs = BlobDirs([tmp_path / "a", tmp_path / "b"])
    used = {blobs.write_blob(xxhash.xxh3_128(bytes([i])).hexdigest(), bytes([i])) for i in range(40)}
    assert used == {0, 1}
    blobs.release()


def test_hash_fd_spans_chunks(tmp_path: Path) -> None:
    import xxhash

    from cachecd.store.blobs import HASH_CHUNK

    for n in (0, 1, HASH_CHUNK, 3 * HASH_CHUNK + 17):
        data = os.urandom(n)
        path = tmp_path / f"b{n}"
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert hash_fd(fd) == (xxhash.xxh3_128(data).hexdigest(), n)
        finally:
            os.close(fd)


def test_a_cache_dir_carries_a_cachedir_tag_that_backup_tools_honour(tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "home" / "cache"
    CacheDir(root, 0)
    (root / "blobs" / "ab").mkdir()
    (root / "blobs" / "ab" / ("ab" + "0" * 30)).write_bytes(b"cached bytes")
    tag = (root / "CACHEDIR.TAG").read_bytes()
    # The spec: the file begins with exactly these 43 bytes.
    assert tag.startswith(b"Signature: 8a477f597d28d172789f06886806bc55")
    if shutil.which("tar") is None:
        pytest.skip("needs tar on PATH to check a backup tool skips the cache")
    (tmp_path / "home" / "notes.txt").write_text("kept")
    listing = subprocess.run(
        ["tar", "--exclude-caches-all", "-cf", "-", "-C", str(tmp_path), "home"],
        capture_output=True, check=True)
    names = subprocess.run(["tar", "-tf", "-"], input=listing.stdout, capture_output=True,
                           check=True).stdout.decode().split()
    assert "home/notes.txt" in names
    assert not [n for n in names if n.startswith("home/cache")], names


def test_a_cachedir_tag_already_there_is_left_as_it_is(tmp_path: Path) -> None:
    own = b"Signature: 8a477f597d28d172789f06886806bc55\n# the user's own\n"
    tmp_path.joinpath("CACHEDIR.TAG").write_bytes(own)
    CacheDir(tmp_path, 0)
    CacheDir(tmp_path, 0)
    assert tmp_path.joinpath("CACHEDIR.TAG").read_bytes() == own
