"""The daemon's Unix sockets: who may connect, and how they are created.

Invariants: a socket directory the daemon creates is 0700, an existing one is never changed and
is refused when others may write to it; each socket is 0600 from the moment it is bound (the
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

from cachecd.errors import CacheLocked, ConfigInvalid, Forbidden

log = logging.getLogger(__name__)

# macOS, <sys/un.h>: the getsockopt level and options of a Unix socket's peer.
SOL_LOCAL, LOCAL_PEERCRED, LOCAL_PEERPID = 0, 0x001, 0x002
# macOS, <sys/ucred.h>: struct xucred { u_int cr_version; uid_t cr_uid; short cr_ngroups;
# gid_t cr_groups[NGROUPS]; } with NGROUPS 16: 76 bytes, 2 of them padding before cr_groups;
# cr_gid is cr_groups[0]. uid_t and gid_t are unsigned: nobody, -2 in the user database, is
# 4294967294, as os.getuid() gives it.
XUCRED = struct.Struct("=IIh2x16I")
XUCRED_VERSION = 0
_PID = struct.Struct("=i")


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """The connected peer's credentials (SO_PEERCRED on Linux, LOCAL_PEERCRED on macOS)."""
    if hasattr(socket, "SO_PEERCRED"):
        # struct ucred: pid_t (signed), uid_t and gid_t (unsigned: a uid above 2**31 stays positive)
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
        pid, uid, gid = struct.unpack("iII", raw)
        return PeerCred(pid, uid, gid)
    return darwin_peer_cred(sock)


def darwin_peer_cred(sock: socket.socket) -> PeerCred:
    """LOCAL_PEERCRED (uid, gid) and LOCAL_PEERPID (pid) of a connected macOS Unix socket."""
    uid, gid = parse_xucred(sock.getsockopt(SOL_LOCAL, LOCAL_PEERCRED, XUCRED.size))
    return PeerCred(parse_peer_pid(sock.getsockopt(SOL_LOCAL, LOCAL_PEERPID, _PID.size)), uid, gid)


def parse_xucred(raw: bytes) -> tuple[int, int]:
    """(uid, gid) of a struct xucred; ``Forbidden`` for anything else (the peer stays unknown)."""
    if len(raw) != XUCRED.size:
        raise Forbidden(f"LOCAL_PEERCRED gave {len(raw)} bytes, not a {XUCRED.size}-byte "
                        "struct xucred: cannot tell who the peer is")
    version, uid, _ngroups, *groups = XUCRED.unpack(raw)
    if version != XUCRED_VERSION:
        raise Forbidden(f"struct xucred version {version}, not {XUCRED_VERSION}: cannot tell "
                        "who the peer is")
    return uid, groups[0]


def parse_peer_pid(raw: bytes) -> int:
    """The pid_t LOCAL_PEERPID gives."""
    if len(raw) != _PID.size:
        raise Forbidden(f"LOCAL_PEERPID gave {len(raw)} bytes, not a pid_t")
    return int(_PID.unpack(raw)[0])


def unix_path_limit(platform: str | None = None) -> int:
    """sockaddr_un's sun_path size: 104 bytes on macOS (<sys/un.h>), 108 on Linux. A path must
    be shorter (it ends in a NUL). ``platform`` is ``sys.platform`` unless given."""
    return 104 if (platform or sys.platform) == "darwin" else 108


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` 0700 (its missing parents as the umask says) when it is missing; an
    existing directory is used as it is, never changed (``--socket /tmp/x.sock`` must not make
    /tmp 0700), and refused when it belongs to someone else or others may write to it.

    Why refuse rather than fix or warn: the sockets are 0600 and every peer's uid is checked, so
    a directory others can read or enter lets no one in; one others can write to lets them
    put their own socket where clients look (before the daemon binds, or after it stops), and
    only its owner may decide to change its mode."""
    try:
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # the mode mkdir was given is masked by the umask
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return ensure_private_dir(path)
    except FileExistsError:
        pass
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ConfigInvalid(f"socket directory {path} belongs to uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & 0o022:
        raise ConfigInvalid(
            f"socket directory {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}), "
            f"so they could put their own socket where clients look; pick --socket in a "
            f"directory of your own (a missing one is created 0700), e.g. {path / 'cachecd'}/"
            f"cachecd.sock")
    return None


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
    if len(os.fsencode(path)) >= unix_path_limit():
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
