"""The pool's default size: what is available beyond a reserve left to the page cache, within
caps; and the sizer that measures again while the engine runs (only a real change resizes).

``available_memory`` is the measurement (MemAvailable here); the tests set what it reads."""

from __future__ import annotations

import pytest

from cachecd_engine.pool import memory

GIB = 1 << 30


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """A 64 GiB machine whose available memory the test sets."""
    state = {"available": 40 * GIB}
    monkeypatch.setattr(memory, "physical_memory", lambda: 64 * GIB)
    monkeypatch.setattr(memory, "available_memory", lambda: state["available"])
    return state


def test_the_pool_leaves_a_quarter_of_memory_to_the_page_cache(machine: dict[str, int]) -> None:
    assert memory.default_pool_bytes() == 40 * GIB - 16 * GIB
    machine["available"] = 10 * GIB  # less than the reserve left: no pool beyond the minimum
    assert memory.default_pool_bytes() == 0
    machine["available"] = 60 * GIB  # plenty: at most half of physical memory
    assert memory.default_pool_bytes() == 32 * GIB


def test_a_running_pool_counts_what_it_holds(machine: dict[str, int]) -> None:
    machine["available"] = 18 * GIB  # the 24 GiB pool already took its share
    assert memory.default_pool_bytes(current=24 * GIB) == 26 * GIB
    machine["available"] = 12 * GIB  # something else grew: give back what eats the reserve
    assert memory.default_pool_bytes(current=24 * GIB) == 20 * GIB


def test_the_sizer_resizes_only_for_a_real_change(machine: dict[str, int]) -> None:
    sizer = memory.PoolSizer(every_s=0.0)
    assert sizer.due()
    machine["available"] = 17 * GIB
    assert sizer.target(24 * GIB) is None  # 25 GiB: within an eighth of 24
    machine["available"] = 10 * GIB
    assert sizer.target(24 * GIB) == 18 * GIB
    later = memory.PoolSizer(every_s=3600.0)
    assert not later.due()
