"""Durable writes: F_FULLFSYNC on Darwin with its fallback, fsync elsewhere, and every durability
point of the product going through ``cachecd.durable``.

The OS is the edge here: on this machine F_FULLFSYNC does not exist, so the Darwin tests replace
the ``fcntl`` module that ``cachecd.durable`` calls with a recorder and the platform with
"darwin"; the Linux path runs on real files. The test marked ``macos`` runs the real call.
"""

from __future__ import annotations

import ast
import errno
import logging
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import xxhash

from cachecd import durable
from cachecd.store.blobs import BlobDirs

ROOT = Path(__file__).resolve().parents[2]
F_FULLFSYNC = 51  # <sys/fcntl.h> on macOS; only the recorder below ever sees it here


class OsEdge:
    """What cachecd.durable asks of the OS, recorded: (call, "file" or "dir") in order."""

    def __init__(self, refuse: int | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.refuse = refuse

    @staticmethod
    def kind(fd: int) -> str:
        return "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"

    def fcntl(self, fd: int, cmd: int) -> int:
        assert cmd == F_FULLFSYNC
        self.calls.append(("F_FULLFSYNC", self.kind(fd)))
        if self.refuse is not None:
            raise OSError(self.refuse, os.strerror(self.refuse))
        return 0


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every os.fsync, recorded (the real one still runs)."""
    calls: list[tuple[str, str]] = []
    real = os.fsync

    def spy(fd: int) -> None:
        calls.append(("fsync", OsEdge.kind(fd)))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


@pytest.fixture
def darwin(monkeypatch: pytest.MonkeyPatch) -> Iterator[OsEdge]:
    """cachecd.durable as on macOS: sys.platform "darwin", an fcntl with F_FULLFSYNC."""
    edge = OsEdge()
    monkeypatch.setattr(durable, "sys", SimpleNamespace(platform="darwin"))
    monkeypatch.setattr(durable, "fcntl", SimpleNamespace(F_FULLFSYNC=F_FULLFSYNC, fcntl=edge.fcntl))
    monkeypatch.setattr(durable, "_warned", set())
    yield edge


def written(tmp_path: Path) -> int:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"bytes that must survive")
    return fd


def test_linux_makes_a_real_file_and_dir_durable_with_fsync(tmp_path: Path, fsyncs: list) -> None:
    fd = written(tmp_path)
    try:
        assert durable.full_fsync(fd, platform="linux") == "fsync"
    finally:
        os.close(fd)
    assert durable.sync_dir(tmp_path, platform="linux") == "fsync"
    assert fsyncs == [("fsync", "file"), ("fsync", "dir")]
    assert (tmp_path / "f").read_bytes() == b"bytes that must survive"


def test_darwin_asks_for_f_fullfsync_and_not_fsync(tmp_path: Path, darwin: OsEdge,
                                                   fsyncs: list) -> None:
    fd = written(tmp_path)
    try:
        assert durable.full_fsync(fd) == "F_FULLFSYNC"
    finally:
        os.close(fd)
    assert durable.sync_dir(tmp_path) == "F_FULLFSYNC"
    assert darwin.calls == [("F_FULLFSYNC", "file"), ("F_FULLFSYNC", "dir")]
    assert fsyncs == []


@pytest.mark.parametrize("refused", [errno.ENOTSUP, errno.ENOTTY, errno.EINVAL])
def test_a_file_system_that_refuses_f_fullfsync_gets_fsync_and_one_warning(
    tmp_path: Path, darwin: OsEdge, fsyncs: list, refused: int, caplog: pytest.LogCaptureFixture
) -> None:
    darwin.refuse = refused
    fd = written(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="cachecd.durable"):
            assert durable.full_fsync(fd) == "fsync"
            assert durable.full_fsync(fd) == "fsync"
    finally:
        os.close(fd)
    assert darwin.calls == [("F_FULLFSYNC", "file")] * 2
    assert fsyncs == [("fsync", "file")] * 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and f"errno={errno.errorcode[refused]}" in warnings[0]


@pytest.mark.parametrize("failed", [errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EROFS,
                                    errno.EBADF])
def test_a_failed_sync_is_raised_not_papered_over_with_fsync(
    tmp_path: Path, darwin: OsEdge, fsyncs: list, failed: int
) -> None:
    darwin.refuse = failed
    fd = written(tmp_path)
    try:
        with pytest.raises(OSError) as exc:
            durable.full_fsync(fd)
    finally:
        os.close(fd)
    assert exc.value.errno == failed and fsyncs == []


def test_a_python_without_f_fullfsync_falls_back_to_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsyncs: list
) -> None:
    def never(fd: int, cmd: int) -> int:
        raise AssertionError("no command number may be sent without F_FULLFSYNC")

    monkeypatch.setattr(durable, "fcntl", SimpleNamespace(fcntl=never))
    monkeypatch.setattr(durable, "_warned", set())
    fd = written(tmp_path)
    try:
        assert durable.full_fsync(fd, platform="darwin") == "fsync"
    finally:
        os.close(fd)
    assert fsyncs == [("fsync", "file")]


# every durability point goes through cachecd.durable -----------------------------------------


def test_a_blob_commit_is_f_fullfsynced_file_then_directory_on_darwin(
    tmp_path: Path, darwin: OsEdge, fsyncs: list
) -> None:
    blobs = BlobDirs([tmp_path])
    data = os.urandom(4096)
    digest = xxhash.xxh3_128(data).hexdigest()
    try:
        blobs.write_blob(digest, data)
        # The first blob of its fan-out dir: blobs/ (which holds the new dir), then the new dir.
        assert darwin.calls == [("F_FULLFSYNC", "file"), ("F_FULLFSYNC", "dir"),
                                ("F_FULLFSYNC", "dir")]
        darwin.calls.clear()
        for i in range(1 << 16):  # bytes whose blob goes in the same fan-out dir
            more = data + i.to_bytes(4, "little")
            if (other := xxhash.xxh3_128(more).hexdigest())[:2] == digest[:2]:
                break
        blobs.write_blob(other, more)
        assert darwin.calls == [("F_FULLFSYNC", "file"), ("F_FULLFSYNC", "dir")]
    finally:
        blobs.release()
    assert fsyncs == []


def test_a_saved_manifest_and_the_resident_file_are_f_fullfsynced_on_darwin(
    tmp_path: Path, darwin: OsEdge, fsyncs: list
) -> None:
    import asyncio

    from cachecd.manifest.build import build_manifest
    from cachecd.manifest.source import LocalSource
    from cachecd.setup.resident import RESIDENT_FILE, ResidentWriter
    from tests.unit.test_manifest import REV, write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt")
    manifest = build_manifest(LocalSource(ckpt, "cachecd/test-moe", REV), progress=False)
    manifest.save(tmp_path / "m" / "x.manifest")
    assert darwin.calls == [("F_FULLFSYNC", "file"), ("F_FULLFSYNC", "dir")]

    async def fetch(name: str, start: int, end: int) -> bytes:
        with open(ckpt / name, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    darwin.calls.clear()
    out = tmp_path / "resident"
    out.mkdir()
    asyncio.run(ResidentWriter(manifest, out).run(fetch, lambda _n: None))
    assert (out / RESIDENT_FILE).exists()
    # Each verified group before its progress record, the whole file before its rename, and the
    # directory after it (the rename itself).
    *files, last = darwin.calls
    assert len(files) >= 2 and set(files) == {("F_FULLFSYNC", "file")}
    assert last == ("F_FULLFSYNC", "dir")
    assert fsyncs == []


def test_write_atomic_replaces_syncs_file_then_dir_and_sets_the_mode(
    tmp_path: Path, darwin: OsEdge, fsyncs: list
) -> None:
    path = tmp_path / "unit" / "cachecd.service"
    durable.write_atomic(path, b"old")
    darwin.calls.clear()
    durable.write_atomic(path, b"new", mode=0o644)
    assert path.read_bytes() == b"new" and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert darwin.calls == [("F_FULLFSYNC", "file"), ("F_FULLFSYNC", "dir")] and fsyncs == []
    assert [p.name for p in path.parent.iterdir()] == ["cachecd.service"]


def test_write_atomic_that_fails_leaves_the_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "x.manifest"
    durable.write_atomic(path, b"old")

    def failed_sync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failed_sync)
    with pytest.raises(OSError, match="Input/output"):
        durable.write_atomic(path, b"new")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["x.manifest"]


def sync_calls_outside_durable() -> list[str]:
    """file:line of every fsync/fdatasync/F_FULLFSYNC in the product outside cachecd/durable.py."""
    found = []
    for folder in ("cachecd", "client", "engine"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "cachecd" / "durable.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Attribute):
                    names = [node.attr]
                elif isinstance(node, ast.Name):
                    names = [node.id]
                elif isinstance(node, ast.ImportFrom):
                    names = [a.name for a in node.names]
                if {"fsync", "fdatasync", "F_FULLFSYNC"} & set(names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_nothing_in_the_product_syncs_except_through_cachecd_durable() -> None:
    assert sync_calls_outside_durable() == [], (
        "use cachecd.durable.full_fsync / sync_dir: on macOS os.fsync does not reach the media")


def test_the_source_walk_finds_a_direct_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for folder in ("cachecd", "client", "engine"):
        (tmp_path / folder).mkdir()
    (tmp_path / "cachecd" / "durable.py").write_text("import os\nos.fsync(0)\n")
    (tmp_path / "cachecd" / "a.py").write_text("import os\n\ndef f(fd):\n    os.fsync(fd)\n")
    (tmp_path / "engine" / "b.py").write_text("from os import fdatasync\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert sync_calls_outside_durable() == ["cachecd/a.py:4", "engine/b.py:1"]


@pytest.mark.macos("F_FULLFSYNC is accepted on a file and a directory of the temp dir's file "
                   "system (APFS), with no fallback")
def test_f_fullfsync_really_runs_on_this_mac(tmp_path: Path, fsyncs: list,
                                             caplog: pytest.LogCaptureFixture) -> None:
    fd = written(tmp_path)
    try:
        assert durable.full_fsync(fd) == "F_FULLFSYNC"
    finally:
        os.close(fd)
    assert durable.sync_dir(tmp_path) == "F_FULLFSYNC"
    assert fsyncs == [] and "full_fsync_refused" not in caplog.text


# the index: LMDB syncs its own file ----------------------------------------------------------


def lmdb_allowed(platform: str, version: str) -> bool:
    import tomllib

    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = [r for r in map(Requirement, deps) if r.name == "lmdb"
            and (r.marker is None or r.marker.evaluate({"sys_platform": platform}))]
    return bool(reqs) and all(r.specifier.contains(version) for r in reqs)


def test_on_macos_the_index_needs_the_py_lmdb_whose_commit_full_fsyncs_the_meta_page() -> None:
    # py-lmdb 3.0 bundles LMDB 0.9.36 (ITS#10454); 1.8-2.x bundle 0.9.35, 1.4-1.7 0.9.29-0.9.33.
    assert lmdb_allowed("darwin", "3.0.0") and not lmdb_allowed("darwin", "2.3.0")
    assert lmdb_allowed("linux", "1.4.0") and lmdb_allowed("linux", "3.0.0")


@pytest.mark.macos("the installed py-lmdb's LMDB is 0.9.36 or newer, whose commit F_FULLFSYNCs "
                   "the meta page (a py-lmdb built against an older system LMDB is not)")
def test_this_macs_lmdb_full_fsyncs_its_meta_page() -> None:
    import lmdb

    assert lmdb.version() >= (0, 9, 36), lmdb.version()
