"""A new revision next to an installed one, as a user updates: the local hub serves both (the
folder ``ORG/NAME`` is main, ``ORG/NAME@v2`` the new branch) behind a proxy that counts every byte
read of the shards. The new revision changes 10% of the experts (all in one shard) and one resident
tensor (in another); setup says what it reuses, and setup plus a run plus a full warm read exactly
the changed bytes and those of the unchanged experts whose shard changed (their blobs count only
for the shard bytes they were verified as: docs/trust.md), never a byte of an expert whose shard
is unchanged. A new manifest that says a changed expert is unchanged gets no old bytes served. Both revisions stay registered, each runs bitwise equal to its own
checkpoint loaded whole by mlx-lm, and removing the old one keeps the blobs the new one uses."""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachecd.errors import InvalidRequest
from cachecd.manifest.manifest import Manifest
from cachecd.sizes import format_size
from tests.exactness import assert_bitwise, run_logits
from tests.fakes.counting_proxy import CountingProxy, Seen
from tests.harness import TINY_REPO, HubProcess, run_cli, short_tmp, stop_daemon

CHANGED_TENSOR = "language_model.model.norm.weight"
PROMPT = [1, 5, 9, 13, 17, 21, 25, 29]


@dataclass
class Revisions:
    old: Manifest
    new: Manifest
    new_dir: Path
    changed_rows: list[int]
    moved_rows: list[int]  # unchanged experts of a shard that changed: verified again
    proxy: CountingProxy
    root: Path
    hub: HubProcess


def _tensor_at(path: Path, name: str) -> tuple[int, int]:
    """(absolute offset, nbytes) of tensor ``name`` in a safetensors file."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        start, end = json.loads(f.read(size))[name]["data_offsets"]
    return 8 + size + start, end - start


def _change(path: Path, name: str, how: Any) -> None:
    offset, nbytes = _tensor_at(path, name)
    with open(path, "r+b") as f:
        f.seek(offset)
        data = how(bytearray(f.read(nbytes)))
        f.seek(offset)
        f.write(data)


def _flip_nibbles(data: bytearray) -> bytearray:  # fp4 codes: every value is a finite weight
    for i in range(min(64, len(data))):
        data[i] ^= 0x11
    return data


def _nudge_bf16(data: bytearray) -> bytearray:  # one ulp up: a finite, different norm weight
    words = np.frombuffer(bytes(data), dtype="<u2").copy()
    words[:8] += 1
    return bytearray(words.tobytes())


@pytest.fixture(scope="module")
def revisions(tiny_dir: Path, tiny_manifest: Manifest) -> Iterator[Revisions]:
    root = short_tmp("cdrev")
    shutil.copytree(tiny_dir, root / TINY_REPO)
    new_dir = root / f"{TINY_REPO}@v2"
    shutil.copytree(tiny_dir, new_dir)
    # 10% of the experts, every other one of the shard holding the most
    shard = Counter(e.ranges[0].file for e in tiny_manifest.experts()
                    if len(e.ranges) == 1).most_common(1)[0][0]
    changed = [i for i in range(tiny_manifest.n_experts)
               if [r.file for r in tiny_manifest.entry(i).ranges] == [shard]][::2]
    assert len(changed) == tiny_manifest.n_experts // 10
    for row in changed:
        packed = tiny_manifest.entry(row).tensors
        w1 = next(t for t in packed if t.name.endswith("w1.weight_packed"))
        _change(new_dir / w1.file, w1.name, _flip_nibbles)
    norm = next(t for t in tiny_manifest.resident if t.name == CHANGED_TENSOR)
    _change(new_dir / norm.file, norm.name, _nudge_bf16)
    # The LFS route: what a new revision reads is counted in Range reads of the shards (the Xet
    # route reads proven windows around them: tests/functional/test_xet_route.py).
    hub = HubProcess(root, extra=["--no-xet"])
    manifests = {}
    for rev in ("main", "v2"):
        out = root / f"{rev}.manifest"
        run_cli("manifest", "build", f"{TINY_REPO}@{rev}", "--endpoint", hub.url, "--output",
                str(out))
        manifests[rev] = Manifest.load(out)
    proxy = CountingProxy(hub.url).start()
    old, new = manifests["main"], manifests["v2"]
    moved = [i for i in range(new.n_experts) if i not in changed
             and any(old.files[r.file].sha256 != new.files[r.file].sha256
                     for r in new.entry(i).ranges)]
    yield Revisions(old, new, new_dir, changed, moved, proxy, root, hub)
    proxy.stop()
    hub.stop()
    shutil.rmtree(root, ignore_errors=True)


def _overlaps(seen: Seen, entry: Any) -> bool:
    first, _, last = seen.range.removeprefix("bytes=").partition("-") if seen.range else ("", "", "")
    start, end = int(first), int(last) + 1
    return any(r.file == seen.path.rsplit("/", 1)[-1] and r.start < end and start < r.end
               for r in entry.ranges)


def _overlap(seen: Seen, entry: Any) -> int:
    """Bytes of ``entry`` that the read ``seen`` covered."""
    first, _, last = seen.range.removeprefix("bytes=").partition("-") if seen.range else ("", "", "")
    start, end = int(first), int(last) + 1
    return sum(max(0, min(end, r.end) - max(start, r.start)) for r in entry.ranges
               if r.file == seen.path.rsplit("/", 1)[-1])


def _data_reads(proxy: CountingProxy, since: int) -> list[Seen]:
    """Range reads of tensor data (a manifest check reads the shards' headers: from byte 0)."""
    return [s for s in proxy.ranges(since) if not (s.range or "").startswith("bytes=0-")]


def _logits(name: str, sock: Path) -> tuple[list[np.ndarray], list[int]]:
    from cachecd_engine.run import load

    model, _ = load(name, sock, ram_bytes=0)  # every layer asks the daemon
    try:
        return run_logits(model, PROMPT, steps=4)
    finally:
        model.bank.source.close()


def test_a_new_revision_fetches_only_what_changed(revisions: Revisions,
                                                   tiny_dir: Path) -> None:
    from mlx_lm.utils import load_model

    from cachecd_client import Client

    rev, proxy = revisions, revisions.proxy
    old, new = rev.old.revision, rev.new.revision
    base = short_tmp("cdrv")
    sock = base / "run" / "s.sock"
    flags = ["--endpoint", proxy.url, "--socket", str(sock), "--cache-dir", str(base / "cache"),
             "--models-dir", str(base / "models")]
    manifest_dir = base / "given"
    manifest_dir.mkdir()
    given = {}
    for m in (rev.old, rev.new):
        given[m.revision] = manifest_dir / f"{m.revision}.manifest"
        shutil.copy(m.source, given[m.revision])
    try:
        run_cli("setup", "--stream", f"{TINY_REPO}@{old}", *flags, "--manifest", str(given[old]))
        with Client(sock) as c:  # the old revision's experts all cached
            for layer in rev.old.moe_layers:
                c.warm(f"{TINY_REPO}@{old}", layer, list(range(rev.old.experts_per_layer)))

        mark = proxy.mark()
        out = run_cli("setup", "--stream", f"{TINY_REPO}@v2", *flags, "--manifest",
                      str(given[new])).stdout
        m, k, v = rev.new.n_experts, len(rev.changed_rows), len(rev.moved_rows)
        v_bytes = sum(rev.new.entry(r).nbytes for r in rev.moved_rows)
        assert v and m - k - v > 0
        assert (f"{m - k - v} of {m} experts unchanged since {old[:12]} and cached, reused; "
                f"{v} unchanged but not in place (their shard changed or they moved): "
                f"{format_size(v_bytes)} to read again and verify") in out, out
        assert f"{k} changed" in out, out
        norm = next(t for t in rev.new.resident if t.name == CHANGED_TENSOR)
        same = re.search(rf"(\d+) of (\d+) resident tensors unchanged since {old[:12]}, copied "
                         r"from its install; 1 changed", out)
        assert same and int(same[1]) + 1 == int(same[2]), out
        # Setup read one resident tensor's bytes of the shards: the changed one; the config and
        # tokenizer files, the same bytes, came from the old install.
        assert [s.nbytes for s in _data_reads(proxy, mark)] == [norm.nbytes]
        assert f"fetched {format_size(norm.nbytes)} now" in out, out

        # The new revision runs as its own checkpoint does, whole in mlx-lm; the old one too.
        mark = proxy.mark()
        reference, _ = load_model(rev.new_dir)
        ref, toks = run_logits(reference, PROMPT, steps=4)
        got, _ = _logits(f"{TINY_REPO}@{new[:12]}", sock)
        assert_bitwise(ref, got)
        with Client(sock) as c:  # and every expert of it: only the changed ones come
            for layer in rev.new.moe_layers:
                c.warm(f"{TINY_REPO}@{new}", layer, list(range(rev.new.experts_per_layer)))
        reads = _data_reads(proxy, mark)
        again = set(rev.changed_rows) | set(rev.moved_rows)
        changed = [rev.new.entry(r) for r in sorted(again)]
        unchanged = [rev.new.entry(r) for r in range(m) if r not in again]
        assert reads and all(any(_overlaps(s, e) for e in changed) for s in reads)
        assert not [s for s in reads if any(_overlaps(s, e) for e in unchanged)]
        # Each of them read whole (a coalesced read may span one the run fetched before it)
        assert all(sum(_overlap(s, e) for s in reads) >= e.nbytes for e in changed)

        old_ref, _ = run_logits(load_model(tiny_dir)[0], PROMPT, steps=4)
        assert_bitwise(old_ref, _logits(f"{TINY_REPO}@{old}", sock)[0])

        # Both are listed; a bare name no longer picks one.
        status = run_cli("status", "--socket", str(sock)).stdout
        assert f"{TINY_REPO}@{old[:12]}" in status and f"{TINY_REPO}@{new[:12]}" in status
        with Client(sock) as c, pytest.raises(InvalidRequest, match="2 revisions"):
            c.model(TINY_REPO)
        cov = run_cli("coverage", "--model", f"{TINY_REPO}@{new[:12]}", "--socket", str(sock))
        assert f"{TINY_REPO}@{new[:12]}" in cov.stdout and f"{m} of {m} experts" in cov.stdout, cov.stdout
        bare = run_cli("coverage", "--socket", str(sock), check=False)
        assert bare.returncode == 1 and f"name one with {TINY_REPO}@REV" in bare.stderr

        # Removing the old revision keeps every blob the new one names: it runs off the cache.
        done = run_cli("remove", "--model", f"{TINY_REPO}@{old}", "--experts", "--socket",
                       str(sock)).stdout
        assert f"removed {TINY_REPO}@{old[:12]}" in done, done
        assert f"{k} cached experts evicted ({m - k} kept: another registered model" in done
        mark = proxy.mark()
        assert_bitwise(ref, _logits(TINY_REPO, sock)[0])  # the one left: the bare name again
        assert proxy.seen[mark:] == []
    finally:
        stop_daemon(sock)


def test_a_new_manifest_cannot_call_a_changed_expert_unchanged(revisions: Revisions,
                                                                tmp_path: Path) -> None:
    """v2's manifest gives a changed expert the digest it had before (its layout honest): the old
    blob is cached, but it was verified as the old shard's bytes, not the new one's."""
    from cachecd.errors import ChecksumMismatch
    from cachecd_client import Client
    from tests import tampered

    rev = revisions
    row = rev.changed_rows[0]
    entry = rev.new.entry(row)
    liar = tampered.hashes_from(Path(rev.new.source), tmp_path / "v2-liar.manifest",
                                Path(rev.old.source), [row])
    base = short_tmp("cdrl")
    sock = base / "run" / "s.sock"
    flags = ["--endpoint", rev.hub.url, "--socket", str(sock), "--cache-dir",
             str(base / "cache"), "--models-dir", str(base / "models")]
    try:
        run_cli("setup", "--stream", f"{TINY_REPO}@{rev.old.revision}", *flags, "--manifest",
                str(rev.old.source))
        with Client(sock) as c:
            c.warm(f"{TINY_REPO}@{rev.old.revision}", entry.layer, [entry.expert])
        out = run_cli("setup", "--stream", f"{TINY_REPO}@v2", *flags, "--manifest",
                      str(liar)).stdout
        with Client(sock) as c:
            with pytest.raises(ChecksumMismatch) as info:
                c.expert(f"{TINY_REPO}@{rev.new.revision}", entry.layer, entry.expert)
            assert str(liar) in info.value.message
            assert f"layer={entry.layer} expert={entry.expert}" in info.value.message
        assert "unchanged but not in place" in out, out  # setup said it would be verified
    finally:
        stop_daemon(sock)
        shutil.rmtree(base, ignore_errors=True)
