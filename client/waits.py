"""Saying so while the daemon takes long to answer: a miss whose fetch the daemon retries (a Hub
that answers 503s or stalls) can keep a read waiting for minutes, and the process that waits
must not look hung.

One watcher thread per client, started at the first read that is still waiting after
``NOTICE_S``; it logs a warning then and every ``REPEAT_S`` while that read waits, with the
daemon's upstream faults so far (``/v1/status``, over a connection of its own). A read that is
answered in time costs two dictionary operations.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cachecd.errors import CachecdError

log = logging.getLogger("cachecd_client")

NOTICE_S, REPEAT_S = 3.0, 10.0


class WaitWatch:
    def __init__(self, socket: Path) -> None:
        self._socket = socket
        self._waiting: dict[int, tuple[float, int, int]] = {}  # id -> (start, layer, experts)
        self._said: dict[int, float] = {}  # id -> when its next notice is due
        self._ids = itertools.count()
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watch(self, layer: int, experts: int) -> Iterator[None]:
        key = next(self._ids)
        self._waiting[key] = (time.monotonic(), layer, experts)
        if self._thread is None:
            self._start()
        try:
            yield
        finally:
            self._waiting.pop(key, None)
            self._said.pop(key, None)

    def _start(self) -> None:
        with self._mu:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="cachecd-wait",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            for key, (start, layer, experts) in list(self._waiting.items()):
                due = self._said.get(key, start + NOTICE_S)
                if now >= due:
                    self._said[key] = now + REPEAT_S
                    log.warning("still waiting for the daemon (%.0f s): layer %d: %d experts; %s",
                                now - start, layer, experts, self._upstream())

    def _upstream(self) -> str:
        from cachecd_client.transport import ControlTransport

        control = ControlTransport(self._socket, 5.0)
        try:
            status = control.request("GET", "/v1/status")
        except (CachecdError, OSError):  # a daemon too busy to say must not end this thread
            return "the daemon does not say why"
        finally:
            control.close()
        return why_waiting(status)

    def close(self) -> None:
        self._stop.set()


def why_waiting(status: dict[str, Any]) -> str:
    """What the daemon is waiting on, from its status: a peer asked first (named, with how long
    its oldest request has taken), else the Hub, with the upstream's faults so far."""
    up = status.get("upstream", {})
    faults = {k.removeprefix("faults_"): v for k, v in up.items()
              if k.startswith("faults_") and v}
    said = ", ".join(f"{k} x{v}" for k, v in sorted(faults.items())) or "none yet"
    asking = [p for p in status.get("peers", []) if p.get("in_flight")]
    if asking:
        slowest = max(asking, key=lambda p: p.get("waiting_s", 0))
        return (f"it is waiting on its peer {slowest['url']} ({slowest['in_flight']} requests "
                f"under way, the oldest for {slowest.get('waiting_s', 0):.0f} s; a peer slower "
                f"than --peer-min-rate is dropped for the Hub), not on the Hub (faults so far: "
                f"{said})")
    return (f"it is fetching from the Hub ({up.get('in_flight', 0)} requests under way, "
            f"faults so far: {said})")
