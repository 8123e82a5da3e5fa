"""The hub's Xet store: a file read in blocks gets the one-pass cuts (hf_xet's hash), is built
once, and its xorbs decode back to the file; the fault knobs parse as the CLI gives them."""

from __future__ import annotations

import random
from pathlib import Path

import hf_xet
import pytest

from cachecd.lanhub import xet_store
from cachecd.lanhub.xet_faults import XetFaults
from cachecd.lanhub.xet_store import XetStore
from cachecd.xet import xorb

DATA = random.Random(21).randbytes(1_500_000) + bytes(600_000) + b"tail"


def test_blocks_give_one_pass_cuts_and_xorbs_decode(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "f.bin"
    f.write_bytes(DATA)
    # Blocks far smaller than a chunk: every cut is made again from the last one of a block.
    monkeypatch.setattr(xet_store, "_READ", 50_000)
    store = XetStore(tmp_path / "served", xorb_bytes=300_000)
    name = store.xet_hash(f, "cd" * 32, len(DATA))
    assert name == hf_xet.hash_files([str(f)])[0].hash
    built = store.load(name)
    assert built is not None and len(built.xorbs) >= 5
    out = b""
    for span in built.xorbs:
        path = store.xorb_path(span.hash)
        assert path is not None
        out += b"".join(xorb.decode_chunks(path.read_bytes(), expect=span.count))
    assert out == DATA


def test_built_once_per_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "f.bin"
    f.write_bytes(DATA)
    first = XetStore(tmp_path / "served").xet_hash(f, "ab" * 32, len(DATA))

    def refuse(*_: object) -> str:
        raise AssertionError("built again")

    monkeypatch.setattr(XetStore, "_build", refuse)
    # Another server over the same folder finds what the first one built.
    assert XetStore(tmp_path / "served").xet_hash(f, "ab" * 32, len(DATA)) == first


def test_an_unwritable_folder_falls_back_to_a_private_one(tmp_path: Path) -> None:
    """Where the store's folder cannot be made (here a file is in the way, which stops root as
    well as a read-only mount would), the hub builds in a temp folder of its own instead."""
    served = tmp_path / "served"
    served.mkdir()
    (served / ".cache").write_text("not a folder")
    f = tmp_path / "f.bin"
    f.write_bytes(DATA[:20_000])
    store = XetStore(served)
    assert not store.dir.is_relative_to(served)
    assert store.xet_hash(f, "ef" * 32, 20_000) == hf_xet.hash_files([str(f)])[0].hash


def test_fault_specs() -> None:
    faults = XetFaults()
    for spec in ("flip_xorb_byte", "proof_offset=4096", "times=2", "swap_xorb=false"):
        faults.set(spec)
    assert faults.flip_xorb_byte and faults.proof_offset == 4096 and not faults.swap_xorb
    assert faults.fire("flip_xorb_byte") and faults.fire("flip_xorb_byte")
    assert not faults.fire("flip_xorb_byte")  # times used up
    with pytest.raises(ValueError, match="unknown xet fault"):
        faults.set("counts")
