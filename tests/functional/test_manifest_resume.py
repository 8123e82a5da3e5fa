"""`cachecd manifest build` killed with SIGKILL halfway resumes where it stopped.

A real `cachecd hub serve` subprocess logs every request it answers (-v); the build runs as a
subprocess with the named crash point ``manifest_part:N`` (SIGKILL right after the N-th shard's
part is durable). What the resumed build asks of the hub is read from the hub's own log: each
shard not finished before the kill is streamed once, a finished one is not touched at all (no
header read, no stream), and the manifest equals a one-shot build byte for byte.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from cachecd.manifest.manifest import Manifest
from tests.harness import TINY_REPO, LoggedHub, run_cli


@pytest.fixture
def logged_hub(hub_root: Path):  # type: ignore[no-untyped-def]
    h = LoggedHub(hub_root)
    yield h
    h.stop()


def _streamed(requests: list[tuple[str, str, int]], status: int) -> list[str]:
    """The files GET from the CDN with this status (200: whole file, 206: a range)."""
    return [path.rsplit("/", 1)[1] for method, path, code in requests
            if method == "GET" and path.startswith("/_cdn/") and code == status]


def test_a_build_killed_halfway_resumes_where_it_stopped(
    logged_hub: LoggedHub, tiny_manifest_path: Path, tmp_path: Path
) -> None:
    one_shot = tiny_manifest_path.read_bytes()  # `cachecd manifest build` in one go, 4 jobs
    shards = Manifest.from_bytes(one_shot).shards
    assert len(shards) == 12
    out = tmp_path / "m.manifest"
    work = tmp_path / "m.manifest.parts"
    build = ["manifest", "build", f"{TINY_REPO}@main", "--endpoint", logged_hub.url,
             "-o", str(out), "--jobs", "2", "--no-progress"]

    killed = run_cli(*build, env={"CACHECD_CRASH_AT": "manifest_part:5"}, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists()
    finished = {json.loads(p.read_text())["file"] for p in work.glob("*.json")}
    # Five parts were durable when the kill came; another worker may have finished its own.
    assert 5 <= len(finished) < len(shards) and finished <= set(shards)

    mark = logged_hub.mark()
    resumed = run_cli(*build)
    assert f"resuming: {len(finished)} of 12 shards already hashed" in resumed.stderr
    asked = logged_hub.requests(mark)
    streamed = [f for f in _streamed(asked, 200) if f.endswith(".safetensors")]
    assert sorted(streamed) == sorted(set(shards) - finished), "each unfinished shard once"
    assert not finished & set(_streamed(asked, 206)), "no header read of a finished shard"
    assert out.read_bytes() == one_shot
    assert not work.exists(), "the work dir goes once the manifest is written"


def test_a_changed_shard_is_not_taken_from_its_part(tiny_dir: Path, tmp_path: Path) -> None:
    """A part names the sha256 the source vouched for: a shard that changed since is hashed
    again (here the builder's own local-folder source vouches for none, so nothing is reused)."""
    from cachecd.manifest.build import build_manifest
    from cachecd.manifest.build_parts import PartStore
    from cachecd.manifest.build_plan import SourceFile
    from cachecd.manifest.source import LocalSource

    rev = "0" * 40
    work = tmp_path / "parts"
    source = LocalSource(tiny_dir, TINY_REPO, rev)
    m = build_manifest(source, progress=False, work_dir=work, jobs=3)
    parts = PartStore(work, TINY_REPO, rev)
    shard = m.files[m.shards[0]]
    vouched = SourceFile(shard.name, shard.size, shard.sha256)
    assert parts.load(vouched) is not None
    assert parts.load(SourceFile(shard.name, shard.size, None)) is None
    assert parts.load(SourceFile(shard.name, shard.size, "1" * 64)) is None
    assert parts.load(SourceFile(shard.name, shard.size + 1, shard.sha256)) is None
    assert PartStore(work, TINY_REPO, "1" * 40).load(vouched) is None
    # A pieces file cut short (a disk that lost it): its part is not used.
    with_pieces = next(p for p in work.glob("*.json") if json.loads(p.read_text())["pieces_bytes"])
    name = json.loads(with_pieces.read_text())["file"]
    with_pieces.with_suffix(".pieces").write_bytes(b"")
    info = m.files[name]
    assert parts.load(SourceFile(name, info.size, info.sha256)) is None


def test_a_hub_stream_resumes_from_a_byte(hub: Any, tiny_dir: Path) -> None:
    """What a broken shard transfer resumes with: a Range from the byte it stopped at, taken only
    as a 206 with exactly that Content-Range."""
    from cachecd.manifest.source import HubSource

    source = HubSource(TINY_REPO, "main", endpoint=hub.url)
    name = "model-00002-of-00012.safetensors"
    data = (tiny_dir / name).read_bytes()
    assert b"".join(source.stream(name)) == data
    assert b"".join(source.stream(name, 12345)) == data[12345:]
