"""Saying so while the daemon takes long to answer: a miss whose fetch the daemon retries (a Hub
that answers 503s or stalls) can keep a read waiting for minutes, and the process that waits
must not look hung.

One watcher thread per client, started at the first read; it logs a warning once a read has
waited ``NOTICE_S`` and every ``REPEAT_S`` while it waits, with the daemon's upstream faults so
far (``/v1/status``, over a connection of its own). A read that is answered in time costs two
dictionary operations.

Progress (``progress``, set by ``Client.on_wait``): while the oldest read waits, from
``PROGRESS_AFTER_S`` and every ``PROGRESS_EVERY_S``, the callback gets the figures of the
daemon's fetches since the read's first tick (``GET /v1/fetches``: cheap, no coverage): fetched
of those being fetched, bytes, rate and time left (``WaitProgress``). They are the daemon's, all
clients' together: one user's prompt is the usual case. A read answered within ``TICK_S`` asks
the daemon nothing.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachecd.errors import CachecdError, NotFound

log = logging.getLogger("cachecd_client")

NOTICE_S, REPEAT_S = 3.0, 10.0
TICK_S = 0.25  # the watcher's period while progress is asked for (0.5 s otherwise)
PROGRESS_AFTER_S, PROGRESS_EVERY_S = 1.0, 1.0


@dataclass(frozen=True)
class WaitProgress:
    """A read waiting on the daemon: ``routed`` experts of ``layer`` asked, for ``waited_s``; of
    the daemon's fetches since, ``fetched`` done (``fetched_bytes``) and ``fetching`` under way
    (``fetching_bytes``), at ``rate`` bytes a second; ``left_s`` None until a byte came."""

    layer: int
    routed: int
    waited_s: float
    fetched: int
    fetched_bytes: int
    fetching: int
    fetching_bytes: int
    rate: float
    left_s: float | None


class WaitWatch:
    def __init__(self, socket: Path) -> None:
        self._socket = socket
        self._waiting: dict[int, tuple[float, int, int]] = {}  # id -> (start, layer, experts)
        self._said: dict[int, float] = {}  # id -> when its next notice is due
        self._ids = itertools.count()
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.progress: Callable[[WaitProgress], None] | None = None
        self._base: dict[int, tuple[float, dict[str, int]]] = {}  # id -> (when, /v1/fetches)
        self._shown: dict[int, float] = {}  # id -> when its next progress is due
        self._control: Any = None  # the watcher thread's own connection for /v1/fetches

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
            self._base.pop(key, None)
            self._shown.pop(key, None)

    def _start(self) -> None:
        with self._mu:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="cachecd-wait",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(TICK_S if self.progress else 0.5):
            now = time.monotonic()
            waiting = list(self._waiting.items())
            if self.progress is not None and waiting:
                self._progress(min(waiting, key=lambda kv: kv[1][0]), now)
            for key, (start, layer, experts) in waiting:
                due = self._said.get(key, start + NOTICE_S)
                if now >= due:
                    self._said[key] = now + REPEAT_S
                    log.warning("still waiting for the daemon (%.0f s): layer %d: %d experts; %s",
                                now - start, layer, experts, self._upstream())

    def _progress(self, read: tuple[int, tuple[float, int, int]], now: float) -> None:
        """Tell ``progress`` how the oldest read's wait goes (its baseline at its first tick)."""
        key, (start, layer, experts) = read
        if key not in self._base:
            if (got := self._fetches()) is not None:
                self._base[key] = (now, got)
            return
        if now < self._shown.get(key, start + PROGRESS_AFTER_S):
            return
        then, base = self._base[key]
        got = self._fetches()
        if got is None or self.progress is None or key not in self._waiting:
            return
        self._shown[key] = now + PROGRESS_EVERY_S
        done = got["fetched_bytes"] - base["fetched_bytes"]
        rate = done / (now - then) if now > then else 0.0
        self.progress(WaitProgress(
            layer, experts, now - start, got["fetched_experts"] - base["fetched_experts"], done,
            got["experts"], got["bytes"], rate, got["bytes"] / rate if rate > 0 else None))

    def _fetches(self) -> dict[str, int] | None:
        from cachecd_client.transport import ControlTransport

        if self._control is None:
            self._control = ControlTransport(self._socket, 5.0)
        try:
            return dict(self._control.request("GET", "/v1/fetches"))
        except NotFound:  # a daemon from before the route: it never will say
            self.progress = None
            return None
        except (CachecdError, OSError):  # one too busy to say: no progress this time
            return None

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
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)  # it may be using its connection: let it end first
        if self._control is not None:
            self._control.close()


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
