"""The service manager's readiness protocol (systemd's ``sd_notify``), for ``Type=notify`` units.

systemd passes a Unix datagram socket in ``NOTIFY_SOCKET`` (a path, or ``@name`` in the abstract
namespace); each datagram is newline-separated ``KEY=VALUE`` lines. The daemon sends ``STATUS=``
while it recovers, ``READY=1`` once both sockets accept connections (so ``systemctl start`` and
anything ordered after the unit wait through recovery instead of meeting "no daemon"), and
``STOPPING=1`` when it starts to drain. Without ``NOTIFY_SOCKET`` (launchd, a shell, tests) every
call does nothing. A failure to notify is logged, never raised: serving matters more.
"""

from __future__ import annotations

import logging
import socket

from cachecd import constants

log = logging.getLogger(__name__)


def notify(*lines: str, address: str | None = None) -> bool:
    """Send ``lines`` (``READY=1``, ``STATUS=...``) as one datagram; whether it was sent."""
    target = address if address is not None else constants.NOTIFY_SOCKET
    if not target:
        return False
    if target.startswith("@"):
        where = "\0" + target[1:]  # the abstract namespace (Linux)
    elif target.startswith("/"):
        where = target
    else:  # vsock: and other transports systemd may grow
        log.warning("event=notify_unsupported_address address=%s", target)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(where)
            sock.sendall("\n".join(lines).encode())
    except OSError as exc:
        log.warning("event=notify_failed address=%s err=%s", target, exc)
        return False
    return True
