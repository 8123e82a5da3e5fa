"""``cachecd openai`` outliving its daemon: a restart, ``service install`` or a crash of the
daemon costs the requests it could not serve a clear error, never the server.

mlx-lm's generation thread dies on the first exception its batched loop does not catch, and its
server then answers every later request "generation thread died" (404) and ``/health`` 503 for
good. Here the loop is started again after such an exception (one process, not ``mlx.launch``,
whose ranks' collectives would fall out of step), and every request the loop had taken gets the
exception as its answer; requests still queued are served by the new loop.

Invariants:
- A read that the daemon stopped answering waits for it to come back (``daemon_source``); only
  a daemon away longer than ``constants.DAEMON_RETURN_S`` fails a request in flight.
- A request that arrives while the daemon does not answer is refused at once with 503 and the
  command that starts one: it would wait for nothing.
- ``/health`` is 200 only while the generation thread runs and the daemon answers.
"""

from __future__ import annotations

import json
import logging
import weakref
from queue import Queue
from typing import Any

from mlx_lm.server import ResponseGenerator

from cachecd.errors import CachecdError

log = logging.getLogger(__name__)


class Unserved(BaseException):  # noqa: N818 - a carrier, not an error of its own
    """A request's ``CachecdError`` raised past mlx-lm's ``except Exception`` (which answers any
    error 404 with a bare string) to the handler, which answers it in OpenAI's shape."""

    def __init__(self, error: CachecdError) -> None:
        super().__init__(error.message)
        self.error = error


class OutlivingGenerator(ResponseGenerator):
    """mlx-lm's ``ResponseGenerator``, its generation loop started again after an exception."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Set before mlx-lm's __init__ starts the thread that uses it.
        self._taken: weakref.WeakSet[Queue[Any]] = weakref.WeakSet()
        super().__init__(*args, **kwargs)

    def _next_request(self, timeout: float | None = None) -> Any:
        request = super()._next_request(timeout)
        if request is not None:
            self._taken.add(request[0])  # its answer queue: the loop owns the request now
        return request

    def _run_generate(self) -> None:
        while True:
            try:
                self._generate()
                return
            except Exception as exc:
                if self._stop or self._is_distributed:
                    log.exception("generation thread died: %s", exc)
                    self._generation_failed = True
                    return
                taken, self._taken = list(self._taken), weakref.WeakSet()
                log.error("generation failed (%s: %s); %d requests get the error, the server "
                          "goes on", type(exc).__name__, exc, len(taken))
                for answers in taken:  # one that had its answer never reads this
                    answers.put(exc)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().generate(*args, **kwargs)
        except CachecdError as exc:
            raise Unserved(exc) from exc


def error_body(status: int, message: str, code: str) -> dict[str, Any]:
    """OpenAI's error shape, so its clients show the message (mlx-lm's own are plain strings)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "code": code}}


def sse_error(error: CachecdError) -> bytes:
    """An error once a stream's headers are out: the event the openai client raises on."""
    return f"data: {json.dumps(error_body(error.http_status, error.message, error.code))}\n\n".encode()


def daemon_down(socket: Any) -> CachecdError | None:
    """The error of a daemon that does not answer its health check on ``socket``, else None."""
    from cachecd_client import Client

    try:
        with Client(socket, timeout=5) as client:
            client.health()
    except CachecdError as exc:
        return exc
    return None


class DaemonAnswers:
    """The handler's answers about the daemon (mixed into ``CachecdHandler`` before mlx-lm's
    ``APIHandler``): ``/health`` that asks it, and a request it could not serve answered in
    OpenAI's shape, before or after a stream's headers went out."""

    headers_sent = False
    provider: Any
    response_generator: Any
    wfile: Any

    def end_headers(self) -> None:
        self.headers_sent = True
        super().end_headers()  # type: ignore[misc]

    def _unserved(self, error: CachecdError) -> None:
        if self.headers_sent:  # a stream under way: its last event says why it ends
            self.wfile.write(sse_error(error))
            self.wfile.flush()
            return
        self._headers_buffer: list[bytes] = []  # the 200 mlx-lm began for an answer it cannot give
        self._error(error.http_status, error.message, error.code)

    def handle_health_check(self) -> None:
        """200 while the generation thread runs and the daemon answers; else 503, saying why."""
        down = daemon_down(self.provider.daemon_socket())
        if down is None and self.response_generator.is_healthy:
            self._json({"status": "ok"})
        elif down is not None:
            self._json({"status": "unavailable", "message": down.message}, 503)
        else:
            self._json({"status": "unavailable", "message": "the generation thread died; "
                        "restart cachecd openai (its log says why)"}, 503)

    def _json(self, body: dict[str, Any], status: int = 200) -> None:
        raise NotImplementedError  # the handler's

    def _error(self, status: int, message: str, code: str) -> None:
        raise NotImplementedError  # the handler's
