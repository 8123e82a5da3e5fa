"""The daemon's Unix sockets: who may connect, and how they are created.

Invariants: the socket directory is 0700 and each socket is 0600 from the moment it is bound (the
umask is set around bind, so there is no window with wider modes); a peer whose uid is not the
daemon's is refused even when it gets past the file mode (root does); a leftover socket file is
unlinked only when connecting to it is refused, never while a daemon answers on it.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from cachecd.errors import CacheLocked, ConfigInvalid

log = logging.getLogger(__name__)

_MAX_UNIX_PATH = 104 if sys.platform == "darwin" else 108


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """The connected peer's credentials (SO_PEERCRED on Linux, LOCAL_PEERCRED on macOS)."""
    if hasattr(socket, "SO_PEERCRED"):
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
        return PeerCred(pid, uid, gid)
    # macOS: struct xucred { u_int cr_version; uid_t cr_uid; short cr_ngroups; gid_t cr_groups[16]; }
    local_peercred, sol_local, local_peerpid = 0x001, 0, 0x002
    raw = sock.getsockopt(sol_local, local_peercred, 4 + 4 + 2 + 2 + 16 * 4)
    _, uid = struct.unpack_from("Ii", raw)
    (gid,) = struct.unpack_from("i", raw, 12)
    pid = struct.unpack("i", sock.getsockopt(sol_local, local_peerpid, 4))[0]
    return PeerCred(pid, uid, gid)


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` 0700 (and its parents); refuse one owned by someone else or open to others."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ConfigInvalid(f"socket directory {path} belongs to uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def _clear_stale(path: Path) -> None:
    # connect() on a regular file also fails with ECONNREFUSED: look before deciding it is a
    # stale socket, or a user's file at the --socket path would be deleted.
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigInvalid(f"{path} exists and is not a socket; remove it or pick --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        log.info("stale socket removed path=%s", path)
        path.unlink(missing_ok=True)
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno == errno.ENOTSOCK:
            raise ConfigInvalid(f"{path} exists and is not a socket; remove it or pick --socket") from exc
        raise
    finally:
        probe.close()
    raise CacheLocked(f"a daemon is already listening on {path}; stop it first (cachecd status)")


def bind_private_socket(path: Path, backlog: int = 128) -> socket.socket:
    """A listening, non-blocking Unix socket at ``path`` with mode 0600 from bind onward."""
    if len(os.fsencode(path)) >= _MAX_UNIX_PATH:
        raise ConfigInvalid(f"socket path {path} is too long for a Unix socket; choose a shorter --socket")
    ensure_private_dir(path.parent)
    if path.exists() or path.is_symlink():
        _clear_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock
