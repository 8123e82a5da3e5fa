"""The CUDA copier's host side, on a machine without a GPU: a bank on CUDA without the CUDA
runtime says so when it starts, and closing a bank releases the copier's pinned staging.

The runtime is the hardware's edge: where a test needs one that pins memory, a stand-in
records the calls the copier makes (``cudaHostRegister``/``cudaHostUnregister``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from cachecd_engine.formats import QUANT_SPECS
from cachecd_engine.pool import cuda_memory, dispatch
from cachecd_engine.pool.bank import ExpertBank
from tests.inprocess_model import DictSource

SPEC = QUANT_SPECS["mxfp4-pack-quantized"]


def _cuda_bank(monkeypatch: pytest.MonkeyPatch) -> ExpertBank:
    monkeypatch.setattr(dispatch, "current_backend", lambda: "cuda")
    return ExpertBank(DictSource({}), SPEC, 1 << 20)


def test_a_bank_on_cuda_without_libcudart_says_so_when_it_starts(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cuda_memory, "_tried", False)
    monkeypatch.setattr(cuda_memory, "_lib", None)
    # A runtime by a name no machine has: the lookup fails as it does without CUDA.
    monkeypatch.setattr(cuda_memory, "RUNTIME_NAMES", ("libcudart-absent.so.13",), raising=False)
    with caplog.at_level(logging.WARNING, logger=cuda_memory.__name__):
        bank = _cuda_bank(monkeypatch)
    assert bank.fill.copier is not None and not bank.fill.copier.on
    lines = [r.getMessage() for r in caplog.records if "cuda_copier_off" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert "libcudart" in lines[0] and "from the host" in lines[0]
    bank.close()


class _Runtime:
    """Stands in for libcudart: pins and unpins, and remembers what is pinned. With ``alive``
    set (a weak reference to the pinned buffer), unpinning checks the buffer still exists."""

    def __init__(self) -> None:
        self.pinned: set[int] = set()
        self.alive: Any = None
        self.freed_first = 0  # unpinned after the buffer was freed

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.pinned.add(ptr)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.pinned.remove(ptr)
        if self.alive is not None and self.alive() is None:
            self.freed_first += 1
        return 0


def test_closing_a_bank_releases_the_pinned_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime: Any = _Runtime()
    monkeypatch.setattr(cuda_memory, "_tried", True)
    monkeypatch.setattr(cuda_memory, "_lib", runtime)
    bank = _cuda_bank(monkeypatch)
    copier = bank.fill.copier
    assert copier is not None and copier.on
    buf = copier.staging(1 << 16)
    assert runtime.pinned == {buf.ctypes.data}
    copier.staging(1 << 18)  # grown: the old buffer is unpinned, the new one pinned
    assert len(runtime.pinned) == 1
    bank.close()
    assert not runtime.pinned


def test_a_bank_let_go_of_without_close_unpins_its_staging_before_it_is_freed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests, reloads and servers drop banks without closing them. Freeing memory that is still
    registered leaves the driver's registration behind (a later buffer at those addresses then
    cannot be pinned and a copy from it reads the old pages): the copier unpins the staging
    when it is collected, while the buffer is still alive."""
    import gc
    import weakref

    runtime: Any = _Runtime()
    monkeypatch.setattr(cuda_memory, "_tried", True)
    monkeypatch.setattr(cuda_memory, "_lib", runtime)
    bank = _cuda_bank(monkeypatch)
    assert bank.fill.copier is not None
    buf = bank.fill.copier.staging(1 << 16)
    runtime.alive = weakref.ref(buf.base)
    del buf, bank
    gc.collect()  # the bank and its filler refer to each other: a cycle
    assert not runtime.pinned
    assert runtime.freed_first == 0


def test_staging_that_cannot_be_pinned_is_said(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """The runtime refuses to pin (712: part of the range is registered already, what memory
    freed while pinned leaves behind): the copier says so with the error, and goes on with
    pageable copies."""
    runtime: Any = _Runtime()
    runtime.cudaHostRegister = lambda ptr, nbytes, flags: 712
    monkeypatch.setattr(cuda_memory, "_tried", True)
    monkeypatch.setattr(cuda_memory, "_lib", runtime)
    bank = _cuda_bank(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=cuda_memory.__name__):
        buf = bank.fill.copier.staging(1 << 16)
    assert buf.size == 1 << 16 and bank.fill.copier.on
    assert "event=cuda_staging_unpinned err=712" in caplog.text
    bank.close()
    assert not runtime.pinned
