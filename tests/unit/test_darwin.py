"""The Darwin branches that can be checked without a Mac, checked here; the rest marked ``macos``.

- LOCAL_PEERCRED / LOCAL_PEERPID: the parser against bytes packed as macOS lays out
  ``struct xucred`` (<sys/ucred.h>) and a ``pid_t``, and the getsockopt calls a socket is asked.
- The cache dir kept from Spotlight and Time Machine: the exact file and extended attribute, the
  attribute's value byte for byte as ``tmutil addexclusion`` writes it, through a setxattr the
  test observes (Linux refuses a "com.apple." attribute name, so the call is recorded, not made).
- launchctl's command lines for each install/uninstall state, against the rendered plist's Label.
- The Unix socket path limit (sun_path is 104 bytes on macOS).
- The engine's memory default where there is no /proc/meminfo.

The OS is the edge: where a test needs macOS's answer it builds that answer as bytes or records
the call; the ``macos`` tests make the real calls on a Mac.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import plistlib
import shutil
import socket
import struct
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from cachecd.daemon.peer import (
    LOCAL_PEERCRED,
    LOCAL_PEERPID,
    SOL_LOCAL,
    PeerCred,
    darwin_peer_cred,
    parse_peer_pid,
    parse_xucred,
    peer_cred,
    unix_path_limit,
)
from cachecd.errors import Forbidden
from cachecd.store import blobs
from cachecd.store.blobs import (
    SPOTLIGHT_MARKER,
    TM_EXCLUDE_VALUE,
    TM_EXCLUDE_XATTR,
    CacheDir,
    exclude_from_indexing,
)

NOBODY_UID = 4294967294  # macOS's nobody: -2 in the user database, (uid_t)-2 on the wire


class Xucred(ctypes.Structure):
    """<sys/ucred.h>'s struct xucred, laid out by ctypes' C rules (not by our format string)."""

    _fields_ = [("cr_version", ctypes.c_uint), ("cr_uid", ctypes.c_uint32),
                ("cr_ngroups", ctypes.c_short), ("cr_groups", ctypes.c_uint32 * 16)]


def xucred(uid: int, groups: list[int], version: int = 0) -> bytes:
    """The bytes LOCAL_PEERCRED returns on a little-endian Mac (arm64 and x86_64 alike)."""
    padded = groups + [0] * (16 - len(groups))
    return struct.pack("<IIh2x16I", version, uid, len(groups), *padded)


# LOCAL_PEERCRED / LOCAL_PEERPID -----------------------------------------------------------------


def test_struct_xucred_is_76_bytes_with_padding_before_the_groups() -> None:
    assert ctypes.sizeof(Xucred) == 76 and Xucred.cr_groups.offset == 12
    assert len(xucred(501, [20])) == 76


@pytest.mark.parametrize(("uid", "groups"), [(501, [20, 12, 61, 79, 80, 81]), (0, [0]),
                                             (NOBODY_UID, [NOBODY_UID])])
def test_xucred_parses_to_the_uid_and_the_first_group(uid: int, groups: list[int]) -> None:
    assert parse_xucred(xucred(uid, groups)) == (uid, groups[0])
    by_c_rules = Xucred(0, uid, len(groups), (ctypes.c_uint32 * 16)(*groups))
    assert parse_xucred(bytes(by_c_rules)) == (uid, groups[0])


def test_nobody_is_its_unsigned_uid_as_os_getuid_gives_it() -> None:
    # Read as a signed int it was -2, and a daemon run as nobody refused its own user.
    assert parse_xucred(xucred(NOBODY_UID, [1]))[0] == NOBODY_UID


@pytest.mark.parametrize("raw", [xucred(501, [20], version=1), xucred(501, [20])[:72], b""])
def test_anything_but_a_version_0_xucred_refuses_the_peer(raw: bytes) -> None:
    with pytest.raises(Forbidden, match="cannot tell who the peer is"):
        parse_xucred(raw)


def test_local_peerpid_is_a_pid_t() -> None:
    assert parse_peer_pid(struct.pack("<i", 4242)) == 4242
    with pytest.raises(Forbidden):
        parse_peer_pid(b"\x01\x02")


class MacUnixSocket:
    """A connected macOS Unix socket as getsockopt sees it: (level, option, buflen) -> bytes."""

    def __init__(self, answers: dict[tuple[int, int, int], bytes]) -> None:
        self.answers = answers
        self.asked: list[tuple[int, int, int]] = []

    def getsockopt(self, level: int, option: int, buflen: int) -> bytes:
        self.asked.append((level, option, buflen))
        return self.answers[(level, option, buflen)]


def test_darwin_peer_cred_asks_sol_local_for_the_cred_and_the_pid() -> None:
    assert (SOL_LOCAL, LOCAL_PEERCRED, LOCAL_PEERPID) == (0, 1, 2)  # <sys/un.h>
    sock = MacUnixSocket({(0, 1, 76): xucred(501, [20, 12]), (0, 2, 4): struct.pack("<i", 777)})
    assert darwin_peer_cred(sock) == PeerCred(pid=777, uid=501, gid=20)  # type: ignore[arg-type]
    assert sock.asked == [(0, 1, 76), (0, 2, 4)]


@pytest.mark.skipif(not hasattr(socket, "SO_PEERCRED"), reason="needs Linux: SO_PEERCRED")
def test_linux_ucred_reads_uid_and_gid_unsigned() -> None:
    # struct ucred is {pid_t pid; uid_t uid; gid_t gid}: a uid above 2**31 (user namespaces,
    # LDAP ranges) must not come back negative and so never equal the daemon's own uid.
    big = 2**32 - 2
    level, option = socket.SOL_SOCKET, socket.SO_PEERCRED
    sock = MacUnixSocket({(level, option, 12): struct.pack("iII", 4242, big, big)})
    assert peer_cred(sock) == PeerCred(pid=4242, uid=big, gid=big)  # type: ignore[arg-type]


@pytest.mark.macos("LOCAL_PEERCRED and LOCAL_PEERPID of a real connection give this process's "
                   "pid, euid and egid")
def test_darwin_peer_cred_of_a_real_connection() -> None:
    base = Path(tempfile.mkdtemp(prefix="cdpeer", dir="/tmp"))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(base / "s"))
        server.listen(1)
        client.connect(str(base / "s"))
        conn, _ = server.accept()
        with conn:
            assert darwin_peer_cred(conn) == PeerCred(os.getpid(), os.geteuid(), os.getegid())
    finally:
        client.close()
        server.close()
        shutil.rmtree(base, ignore_errors=True)


def test_the_socket_path_limit_is_sun_path() -> None:
    assert unix_path_limit("darwin") == 104 and unix_path_limit("linux") == 108


# Spotlight and Time Machine ---------------------------------------------------------------------

# The value of com.apple.metadata:com_apple_backup_excludeItem as `tmutil addexclusion` writes
# it, copied from eclecticlight.co ("xattr: com.apple.metadata:com_apple_backup_excludeItem"):
# "bplist00", the string "com.apple.backupd", its offset, and the 32-byte trailer.
TMUTIL_VALUE = bytes.fromhex(
    "62706c69 73743030 5f101163 6f6d2e61 70706c65 2e626163 6b757064 08000000 00000001 01000000"
    " 00000000 01000000 00000000 00000000 00000000 1c"
)


def test_the_time_machine_exclusion_is_tmutils_attribute_and_value() -> None:
    assert TM_EXCLUDE_XATTR == "com.apple.metadata:com_apple_backup_excludeItem"
    assert TM_EXCLUDE_VALUE == TMUTIL_VALUE
    assert plistlib.loads(TM_EXCLUDE_VALUE) == "com.apple.backupd"
    assert SPOTLIGHT_MARKER == ".metadata_never_index"


def test_exclusion_writes_the_spotlight_marker_and_sets_the_attribute(tmp_path: Path) -> None:
    calls: list[tuple[Path, str, bytes]] = []
    exclude_from_indexing(tmp_path, lambda *call: calls.append(call))
    assert (tmp_path / ".metadata_never_index").read_bytes() == b""
    assert calls == [(tmp_path, "com.apple.metadata:com_apple_backup_excludeItem", TMUTIL_VALUE)]


def test_a_refused_attribute_is_logged_and_the_marker_stays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(path: Path, name: str, value: bytes) -> None:
        raise OSError(errno.ENOTSUP, "Operation not supported", str(path))

    with caplog.at_level(logging.WARNING, logger="cachecd.store.blobs"):
        exclude_from_indexing(tmp_path, refuse)
    assert (tmp_path / SPOTLIGHT_MARKER).exists()
    assert "event=tm_exclude_failed" in caplog.text


def test_a_cache_dir_excludes_itself_on_darwin_only(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Path, str, bytes]] = []
    monkeypatch.setattr(blobs, "darwin_setxattr", lambda *call: calls.append(call))
    monkeypatch.setattr(blobs, "EXCLUDE_FROM_INDEXING", False)
    CacheDir(tmp_path / "linux", 0)
    assert calls == [] and not (tmp_path / "linux" / SPOTLIGHT_MARKER).exists()
    monkeypatch.setattr(blobs, "EXCLUDE_FROM_INDEXING", True)
    CacheDir(tmp_path / "mac", 0)
    assert calls == [(tmp_path / "mac", TM_EXCLUDE_XATTR, TM_EXCLUDE_VALUE)]
    assert (tmp_path / "mac" / SPOTLIGHT_MARKER).exists()


def _darwin_getxattr(path: Path, name: str) -> bytes:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.getxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p,
                              ctypes.c_size_t, ctypes.c_uint32, ctypes.c_int]
    libc.getxattr.restype = ctypes.c_ssize_t
    buf = ctypes.create_string_buffer(256)
    n = libc.getxattr(os.fsencode(path), name.encode(), buf, len(buf), 0, 0)
    if n < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return buf.raw[:n]


@pytest.mark.macos("a new cache dir holds .metadata_never_index and the Time Machine attribute, "
                   "read back with getxattr(2), and `tmutil isexcluded` calls it excluded")
def test_a_cache_dir_on_this_mac_is_excluded() -> None:
    # Under the home directory: temp dirs in /var/folders are excluded from backups anyway.
    root = Path(tempfile.mkdtemp(prefix=".cachecd-test-", dir=Path.home()))
    try:
        before = subprocess.run(["tmutil", "isexcluded", str(root)], capture_output=True,
                                text=True, check=True, timeout=60).stdout
        CacheDir(root / "cache", 0)
        assert (root / "cache" / SPOTLIGHT_MARKER).exists()
        assert _darwin_getxattr(root / "cache", TM_EXCLUDE_XATTR) == TMUTIL_VALUE
        after = subprocess.run(["tmutil", "isexcluded", str(root / "cache")],
                               capture_output=True, text=True, check=True, timeout=60).stdout
        assert "[Excluded]" in after and "[Excluded]" not in before, (before, after)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# launchctl ----------------------------------------------------------------------------------------


def test_launchctl_command_lines_for_every_state_name_the_plists_label(tmp_path: Path) -> None:
    """launchctl(1): `bootstrap <domain-target> <path>`; `bootout`, `enable` and `print` take a
    service target, `gui/<uid>/<Label>`, whose label must be the one in the loaded plist."""
    from cachecd.service.manager import Launchd
    from cachecd.service.render import ServiceSpec

    mgr = Launchd()
    spec = ServiceSpec(program=["/opt/cachecd/bin/cachecd", "serve"], environment={},
                       working_directory=tmp_path, writable_dirs=[tmp_path],
                       socket=tmp_path / "s.sock", log_file=tmp_path / "cachecd.log",
                       shutdown_timeout=10.0)
    label = plistlib.loads(mgr.render(spec).encode())["Label"]
    assert mgr.path.name == f"{label}.plist" and mgr.path.parent.name == "LaunchAgents"
    domain, target = f"gui/{os.getuid()}", f"gui/{os.getuid()}/{label}"
    bootstrap = ["launchctl", "bootstrap", domain, str(mgr.path)]

    def argvs(cmds: list) -> list[list[str]]:
        return [c.argv for c in cmds]

    assert argvs(mgr.install_commands(changed=True, loaded=False)) == [
        ["launchctl", "enable", target], bootstrap]
    assert argvs(mgr.install_commands(changed=False, loaded=False)) == [
        ["launchctl", "enable", target], bootstrap]
    # A changed file replaces a loaded job: out first, or bootstrap says it is already loaded.
    assert argvs(mgr.install_commands(changed=True, loaded=True)) == [
        ["launchctl", "bootout", target], ["launchctl", "enable", target], bootstrap]
    assert argvs(mgr.install_commands(changed=False, loaded=True)) == [
        ["launchctl", "enable", target]]
    assert [c.retries for c in mgr.install_commands(changed=True, loaded=True)] == [0, 0, 5]
    before, after = mgr.uninstall_commands(loaded=True)
    assert argvs(before) == [["launchctl", "bootout", target]] and after == []
    assert mgr.uninstall_commands(loaded=False) == ([], [])
    assert mgr.status_command() == ["launchctl", "print", target]


# the engine's memory defaults ---------------------------------------------------------------------


def test_on_darwin_without_vm_stat_available_memory_is_physical_memory_less_what_mlx_holds(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """macOS has no /proc/meminfo; where ``vm_stat`` cannot be read either (its parsing is
    tests/unit/test_memory.py's), the pool's default size comes from sysconf and MLX."""
    import mlx.core as mx

    from cachecd_engine.pool import machine, memory

    monkeypatch.setattr(memory, "sys", SimpleNamespace(platform="darwin"))
    monkeypatch.setattr(memory, "Path", None)  # any read of /proc would fail loudly
    monkeypatch.setattr(machine, "darwin_available", lambda total: None)
    held = mx.zeros((1 << 20,), dtype=mx.uint8)
    mx.eval(held)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert memory.available_memory() == total - mx.get_active_memory()
    reserve = max(memory.MIN_RESERVE, int(total * memory.RESERVE_SHARE))
    want = total - mx.get_active_memory() - reserve
    assert memory.default_pool_bytes() == max(0, min(want, int(total * memory.POOL_CAP_SHARE)))
