"""The pool's default size: what is available beyond a reserve left to the page cache, within
caps; and the sizer that measures again while the engine runs (only a real change resizes).

``available_memory`` is the measurement (MemAvailable here); the tests set what it reads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from cachecd_engine.pool import machine, memory

GIB = 1 << 30


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """A 64 GiB machine whose available memory the test sets."""
    state = {"available": 40 * GIB}
    monkeypatch.setattr(memory, "physical_memory", lambda: 64 * GIB)
    monkeypatch.setattr(memory, "available_memory", lambda: state["available"])
    return state


def test_the_pool_leaves_a_quarter_of_memory_to_the_page_cache(host: dict[str, int]) -> None:
    assert memory.default_pool_bytes() == 40 * GIB - 16 * GIB
    host["available"] = 10 * GIB  # less than the reserve left: no pool beyond the minimum
    assert memory.default_pool_bytes() == 0
    host["available"] = 60 * GIB  # plenty: at most half of physical memory
    assert memory.default_pool_bytes() == 32 * GIB


def test_a_running_pool_counts_what_it_holds(host: dict[str, int]) -> None:
    host["available"] = 18 * GIB  # the 24 GiB pool already took its share
    assert memory.default_pool_bytes(current=24 * GIB) == 26 * GIB
    host["available"] = 12 * GIB  # something else grew: give back what eats the reserve
    assert memory.default_pool_bytes(current=24 * GIB) == 20 * GIB


def test_the_sizer_resizes_only_for_a_real_change(host: dict[str, int]) -> None:
    sizer = memory.PoolSizer(every_s=0.0)
    assert sizer.due()
    host["available"] = 17 * GIB
    assert sizer.target(24 * GIB) is None  # 25 GiB: within an eighth of 24
    host["available"] = 10 * GIB
    assert sizer.target(24 * GIB) == 18 * GIB
    later = memory.PoolSizer(every_s=3600.0)
    assert not later.due()


# where the machine's limit really is ---------------------------------------------------------------

# ``vm_stat`` on a 16 GiB Mac (16 KiB pages) whose other processes hold most of memory: 1.1 GiB in
# the compressor's 4 GiB, 5.6 GiB of anonymous memory, 2.8 GiB wired; the page cache is 3.1 GiB.
VM_STAT = """\
Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                                3251.
Pages active:                            284236.
Pages inactive:                          280383.
Pages speculative:                         2330.
Pages throttled:                              0.
Pages wired down:                        181092.
Pages purgeable:                           7811.
"Translation faults":                 561237443.
Pages copy-on-write:                   19232373.
Pages zero filled:                    244392788.
Pages reactivated:                      6723488.
Pages purged:                           1924421.
File-backed pages:                       200190.
Anonymous pages:                         366759.
Pages stored in compressor:              717112.
Pages occupied by compressor:            262097.
Decompressions:                        14567420.
Compressions:                          22153120.
Pageins:                                7542393.
Pageouts:                                105226.
Swapins:                                 543521.
Swapouts:                                770032.
"""


def _cgroup_v2(tmp: Path, limit: str, current: int, inactive: int) -> tuple[Path, Path]:
    """A cgroup v2 tree: the process in /machine.slice/job (limited), its parent unlimited."""
    root = tmp / "sys"
    leaf = root / "machine.slice" / "job"
    leaf.mkdir(parents=True)
    (root / "machine.slice" / "memory.max").write_text("max\n")
    (root / "machine.slice" / "memory.current").write_text(f"{40 * GIB}\n")
    (leaf / "memory.max").write_text(f"{limit}\n")
    (leaf / "memory.current").write_text(f"{current}\n")
    (leaf / "memory.stat").write_text(f"anon {current - inactive}\ninactive_file {inactive}\n")
    proc = tmp / "cgroup"
    proc.write_text("0::/machine.slice/job\n")
    return root, proc


def test_a_cgroup_v2_limit_and_what_is_left_under_it(tmp_path: Path) -> None:
    root, proc = _cgroup_v2(tmp_path, str(8 * GIB), 6 * GIB, 1 * GIB)
    # The droppable page cache (inactive files) counts as free, as MemAvailable counts it.
    assert machine.cgroup_memory(root, proc) == machine.CgroupMemory(8 * GIB, 3 * GIB)
    (root / "machine.slice" / "memory.max").write_text(f"{41 * GIB}\n")  # a tighter parent
    assert machine.cgroup_memory(root, proc) == machine.CgroupMemory(41 * GIB, 1 * GIB)
    (root / "machine.slice" / "memory.max").write_text("max\n")
    (root / "machine.slice" / "job" / "memory.max").write_text("max\n")
    assert machine.cgroup_memory(root, proc) is None  # no limit anywhere


def test_a_cgroup_v1_limit_in_a_container_namespace(tmp_path: Path) -> None:
    """v1 on a hybrid host: the memory controller's line names a host path the container's mount
    does not show (the container's cgroup is its mount's root)."""
    mount = tmp_path / "sys" / "memory"
    mount.mkdir(parents=True)
    (mount / "memory.limit_in_bytes").write_text(f"{16 * GIB}\n")
    (mount / "memory.usage_in_bytes").write_text(f"{10 * GIB}\n")
    (mount / "memory.stat").write_text(f"inactive_file 0\ntotal_inactive_file {2 * GIB}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/docker/0123abcd\n1:cpu:/\n0::/\n")
    assert machine.cgroup_memory(tmp_path / "sys", proc) == machine.CgroupMemory(16 * GIB,
                                                                                 8 * GIB)
    (mount / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert machine.cgroup_memory(tmp_path / "sys", proc) is None


def test_in_a_container_the_pool_is_sized_from_its_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 64 GiB host whose /proc/meminfo says 40 GiB are available, in an 8 GiB container with
    3 GiB left: the pool takes what is left beyond the reserve of the container's 8 GiB."""
    root, proc = _cgroup_v2(tmp_path, str(8 * GIB), 6 * GIB, 1 * GIB)
    monkeypatch.setattr(machine, "CGROUP_ROOT", root)
    monkeypatch.setattr(machine, "PROC_CGROUP", proc)
    monkeypatch.setattr(memory, "sys", SimpleNamespace(platform="linux"))
    monkeypatch.setattr(memory, "physical_memory", lambda: 64 * GIB)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {64 << 20} kB\nMemAvailable: {40 << 20} kB\n")
    monkeypatch.setattr(memory, "Path", lambda p: meminfo if p == "/proc/meminfo" else Path(p))
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert memory.default_pool_bytes() == 3 * GIB - 2 * GIB  # the reserve: 2 GiB at least
    # The sizer running a 1 GiB pool as the container fills: it gives the pool up.
    (root / "machine.slice" / "job" / "memory.current").write_text(f"{int(7.5 * GIB)}\n")
    assert memory.PoolSizer(every_s=0.0).target(1 * GIB) == int(0.5 * GIB)


def test_on_a_mac_other_processes_memory_counts() -> None:
    total = 16 * GIB
    # free + page cache + purgeable pages: 211,252 pages of 16 KiB
    assert machine.vm_stat_available(VM_STAT, total) == 211252 * 16384
    # A page counted twice is capped by what wired, compressed and anonymous memory leave.
    busy = VM_STAT.replace("File-backed pages:                       200190.",
                           "File-backed pages:                       900000.")
    assert machine.vm_stat_available(busy, total) == total - 802137 * 16384
    assert machine.vm_stat_available("not vm_stat", total) is None


def test_a_mac_that_would_page_gets_no_pool_beyond_the_minimum(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Mac of ``VM_STAT``: 3.2 GiB available is less than its 4 GiB reserve, so the default
    pool is the minimum (0: two calls' slots), not the half of RAM that physical memory less
    MLX's own would give."""
    monkeypatch.setattr(memory, "sys", SimpleNamespace(platform="darwin"))
    monkeypatch.setattr(memory, "physical_memory", lambda: 16 * GIB)
    monkeypatch.setattr(machine, "darwin_available",
                        lambda total: machine.vm_stat_available(VM_STAT, total))
    assert memory.available_memory() == 211252 * 16384
    assert memory.default_pool_bytes() == 0
    # The other processes quit: 300,000 anonymous pages and the compressor's pages are free.
    idle = (VM_STAT.replace("Pages free:                                3251.",
                            "Pages free:                              565348.")
            .replace("Anonymous pages:                         366759.",
                     "Anonymous pages:                          66759.")
            .replace("Pages occupied by compressor:            262097.",
                     "Pages occupied by compressor:                 0."))
    monkeypatch.setattr(machine, "darwin_available",
                        lambda total: machine.vm_stat_available(idle, total))
    assert memory.default_pool_bytes() == (211252 + 562097) * 16384 - 4 * GIB


def test_on_a_gpu_the_pool_is_what_is_free_beyond_a_reserve() -> None:
    """An 80 GiB GPU with a 30 GiB model and KV cache: 50 GiB free; the pool leaves 8 GiB of
    it (a tenth of the card) to the KV cache's growth, not a flat half of the card."""
    assert memory.pool_bytes_for(512 * GIB, 400 * GIB, 0, 80 * GIB, 50 * GIB) == 42 * GIB
    # A running 20 GiB pool counts as its own; the KV cache grew by 6 GiB since: 24 GiB free.
    assert memory.pool_bytes_for(512 * GIB, 400 * GIB, 20 * GIB, 80 * GIB, 24 * GIB) == 36 * GIB
    assert memory.pool_bytes_for(512 * GIB, 400 * GIB, 0, 80 * GIB, None) == 40 * GIB  # unmeasured
