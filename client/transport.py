"""Talking to the daemon: HTTP over the control socket, fd passing over the data socket.

Connection failures become ``DaemonUnavailable`` at once (connect on a Unix socket fails in
microseconds when nothing listens), with a message naming the commands that start a daemon.
Requests here are idempotent, so a connection that broke (daemon restarted) is reopened and the
request sent again, once.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import queue
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import xxhash

from cachecd import protocol
from cachecd.errors import DaemonUnavailable, error_from_wire

START_HINT = "start one with `cachecd serve` (foreground) or `cachecd service install`"
_CHUNK = 4 << 20
# Reads are grouped into pool jobs of at least this many bytes: a thread hand-off costs tens of
# microseconds, about what reading 256 KiB from the page cache takes. A call whose reads fit in
# one job runs in the caller's thread.
_MIN_JOB = 256 << 10
_HASH_SPAN = 256 << 10  # a checked read's span: read, then hashed while in cache
_RECV_SIZE = 64 * 1024


def unavailable(path: Path, exc: OSError) -> DaemonUnavailable:
    return DaemonUnavailable(f"no cachecd daemon answers on {path} ({exc.strerror or exc}); {START_HINT}")


def connect_unix(path: Path, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        raise unavailable(path, exc) from None
    return sock


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = connect_unix(self._path, self.timeout)  # type: ignore[arg-type]


class ControlTransport:
    def __init__(self, path: Path, timeout: float) -> None:
        self.path = path
        self._timeout = timeout
        self._conn: _UnixHTTPConnection | None = None

    def request(self, method: str, url: str, body: Any = None, raw: bool = False,
                headers: dict[str, str] | None = None) -> Any:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json"} if data is not None and not isinstance(body, bytes) else {}
        hdrs.update(headers or {})
        for attempt in (0, 1):
            conn = self._conn or _UnixHTTPConnection(self.path, self._timeout)
            self._conn = conn
            try:
                conn.request(method, url, body=data, headers=hdrs)
                resp = conn.getresponse()
                payload = resp.read()
                break
            except (ConnectionError, http.client.RemoteDisconnected, BrokenPipeError) as exc:
                self.close()
                if attempt:
                    raise unavailable(self.path, exc) from None
            except BaseException:
                self.close()  # a half-used connection cannot carry the next request
                raise
        if resp.status >= 400:
            try:
                raise error_from_wire(json.loads(payload), resp.status)
            except json.JSONDecodeError:
                raise error_from_wire(payload[:200], resp.status) from None
        if raw:
            return payload, dict(resp.getheaders())
        return json.loads(payload) if payload else None

    def close(self) -> None:
        if self._conn:
            self._conn.close()
            self._conn = None


def _recv_answer(sock: socket.socket, fds: list[int]) -> dict[str, Any]:
    """One answer frame, usually in a single receive (the fds come with its first byte)."""
    reader = protocol.FrameReader()
    while (body := reader.next()) is None:
        msg, got_fds, _flags, _addr = socket.recv_fds(sock, max(_RECV_SIZE, reader.want()),
                                                      protocol.MAX_FDS_PER_FRAME)
        fds.extend(got_fds)
        if not msg:
            raise ConnectionResetError("daemon closed the data connection")
        reader.feed(msg)
    # The daemon answers one frame per request, so nothing can follow it.
    return protocol.decode(body)


def _discard(sock: socket.socket, fds: list[int]) -> None:
    sock.close()
    for fd in fds:
        os.close(fd)


class DataTransport:
    """A small pool of data connections, so several threads can ask at once."""

    def __init__(self, path: Path, timeout: float) -> None:
        self.path = path
        self._timeout = timeout
        self._idle: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()

    def _take(self) -> socket.socket:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            return connect_unix(self.path, self._timeout)

    def request(self, payload: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        frame = protocol.encode(payload)
        for attempt in (0, 1):
            sock = self._take()
            fds: list[int] = []
            try:
                sock.sendall(frame)
                answer = _recv_answer(sock, fds)
            except (TimeoutError, ConnectionError, BrokenPipeError, OSError) as exc:
                _discard(sock, fds)
                if attempt:
                    raise unavailable(self.path, exc) from None
                continue
            except BaseException:
                # A malformed answer (or Ctrl-C mid-frame): every fd that came with it is
                # closed here, or each bad answer would leak them; the connection is spent.
                _discard(sock, fds)
                raise
            self._idle.put(sock)
            if not answer.get("ok"):
                for fd in fds:
                    os.close(fd)
                raise error_from_wire(answer)
            return answer, fds
        raise AssertionError("unreachable")

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


Target = memoryview | Sequence[memoryview]  # one buffer, or a list the bytes fill in order
# One job's reads: (out, fd, the window's buffers, its file offset, its end).
_Piece = tuple[int, int, list[memoryview], int, int]


class _Check:
    """One out's xxh3-128, fed its spans in file order by the reader threads as they land.

    A span that lands before the one ahead of it waits in ``early``; the thread that lands the
    one ahead hashes both. So no reader ever waits for another, the hash overlaps the reads
    still under way, and a span is mostly hashed by the thread that read it, right after, its
    bytes still in that core's cache (no second pass over memory)."""

    def __init__(self) -> None:
        self.hash = xxhash.xxh3_128()
        self.pos = 0  # the bytes hashed so far
        self.early: dict[int, tuple[int, list[memoryview]]] = {}  # start -> (end, buffers)
        self.busy = False  # a thread is hashing: it also takes whatever lands meanwhile
        self.lock = threading.Lock()

    def landed(self, start: int, end: int, views: list[memoryview]) -> None:
        with self.lock:
            if self.busy or start != self.pos:  # hashed by the thread that lands the one ahead
                self.early[start] = (end, views)
                return
            self.busy = True
        try:
            while True:
                for view in views:
                    self.hash.update(view)
                with self.lock:
                    self.pos = end
                    window = self.early.pop(end, None)
                    if window is None:
                        self.busy = False
                        return
                end, views = window
        except BaseException:  # the out fails its check (never fully hashed); the error rises
            with self.lock:
                self.busy = False
            raise

    def digest(self, size: int) -> bytes | None:
        """The out's digest, None unless every one of its ``size`` bytes was hashed."""
        return self.hash.digest() if self.pos == size and not self.early else None


def parallel_preadv(pool: ThreadPoolExecutor, fds: Sequence[int], sizes: Sequence[int],
                    outs: Sequence[Target],
                    landed: Callable[[int, int], None] | None = None,
                    digests: Sequence[bytes | None] | None = None) -> list[int]:
    """Fill ``outs[i]`` with the first ``sizes[i]`` bytes of ``fds[i]``: 4 MiB windows of the
    file across the pool, small reads grouped into one job, and all of them inline when they fit
    in one job. Returns the outs whose bytes failed their digest (none without ``digests``).

    An out may be a list of buffers (an iovec): the file's bytes fill them one after another, so
    one expert can land in several arrays with no copy in between. A window is one ``preadv``
    whatever the buffers it spans (fewer, aligned reads: 6% faster here than one per buffer).

    ``digests[i]``, if given, is out ``i``'s xxh3-128: the windows are then read interleaved
    (every out's first, then every second, ...) in 256 KiB spans, each hashed by the reader
    thread that read it right after its read, in file order (``_Check``): the bytes are checked
    as they come off the disk, before this returns, and the hash overlaps the reads.

    ``landed(i, n)``, if given, is called on the caller's thread, each out's in order (outs
    in turn, or interleaved where checked), as soon as the
    first ``n`` bytes of ``outs[i]`` are in place, once a job's windows are read (``n`` grows
    for each out and ends at ``sizes[i]``), while later windows are still being read: a GPU
    copy of what landed overlaps the reads after it, and the copy left after the last read is
    one window's, not a whole expert's. Landed bytes are not yet checked: only the return says
    which outs are good. On an error every job still running is waited for before it is
    raised: no read writes into the outs after this returns or raises.
    """
    jobs, finished = _plan(fds, sizes, outs, interleave=digests is not None)
    checks = None if digests is None else [_Check() for _ in sizes]
    if len(jobs) == 1:
        _read_pieces(jobs[0], checks)
        if landed is not None:
            for i, n in finished[0].items():
                landed(i, n)
        return _failed(checks, sizes, digests)
    futures = [pool.submit(_read_pieces, job, checks) for job in jobs]
    try:
        for fut, job_done in zip(futures, finished, strict=True):
            fut.result()
            if landed is not None:
                for i, n in job_done.items():
                    landed(i, n)
    except BaseException:
        for fut in futures:
            fut.cancel()
        wait(futures)
        raise
    return _failed(checks, sizes, digests)


def _plan(fds: Sequence[int], sizes: Sequence[int], outs: Sequence[Target],
          interleave: bool) -> tuple[list[list[_Piece]], list[dict[int, int]]]:
    """The reads as jobs of windows, and per job each out's bytes in place once it is read.
    Out after out; or, to check them (``interleave``), every out's first window, then every
    second one, ...: the readers then read different outs at once, and a window lands after
    the one before it in its file, so its reader hashes it at once, still in its cache."""
    per_out: list[list[_Piece]] = []
    for i, (fd, size, out) in enumerate(zip(fds, sizes, outs, strict=False)):
        spans = _spans(out, size)
        ends = [(a, min(size, a + _CHUNK)) for a in range(0, size, _CHUNK)] or [(0, 0)]
        per_out.append([(i, fd, _window(spans, a, b), a, b) for a, b in ends])
    order = itertools.chain.from_iterable(
        itertools.zip_longest(*per_out) if interleave else per_out)
    jobs: list[list[_Piece]] = [[]]
    finished: list[dict[int, int]] = [{}]
    job_bytes = 0
    for piece in order:
        if piece is None:
            continue
        if job_bytes >= _MIN_JOB:
            jobs.append([])
            finished.append({})
            job_bytes = 0
        jobs[-1].append(piece)
        finished[-1][piece[0]] = piece[4]
        job_bytes += piece[4] - piece[3]
    return jobs, finished


def _failed(checks: list[_Check] | None, sizes: Sequence[int],
            digests: Sequence[bytes | None] | None) -> list[int]:
    if checks is None or digests is None:
        return []
    return [i for i, (c, n, want) in enumerate(zip(checks, sizes, digests, strict=True))
            if want is not None and c.digest(n) != bytes(want)]


def _window(spans: list[tuple[memoryview, int]], start: int, end: int) -> list[memoryview]:
    """The parts of the buffers that file bytes [start, end) go to."""
    out = []
    for view, pos in spans:
        lo, hi = max(start, pos), min(end, pos + len(view))
        if lo < hi:
            out.append(view[lo - pos:hi - pos])
    return out


def _spans(out: Target, size: int) -> list[tuple[memoryview, int]]:
    """(buffer, file offset) covering the first ``size`` bytes of the file, in order."""
    views = [out] if isinstance(out, memoryview) else list(out)
    spans: list[tuple[memoryview, int]] = []
    pos = 0
    for view in views:
        if pos >= size:
            break
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        take = view[:size - pos]
        spans.append((take, pos))
        pos += len(take)
    if pos < size:
        raise ValueError(f"buffers hold {pos} bytes, the file has {size}")
    return spans


def _read_pieces(pieces: list[_Piece], checks: list[_Check] | None) -> None:
    for i, fd, views, offset, end in pieces:
        if checks is None:
            _read_piece(fd, views, offset)
            continue
        # Checked: read in spans small enough that the hash right after finds them in this
        # core's cache (the kernel's copy into a cold destination left a 4 MiB window hashing
        # at half the speed of a 256 KiB span here).
        for lo, hi, part in _parts(views, offset, _HASH_SPAN):
            _read_piece(fd, part, lo)
            checks[i].landed(lo, hi, part)
        if offset == end:
            checks[i].landed(offset, end, [])


def _parts(views: list[memoryview], start: int,
           step: int) -> Iterator[tuple[int, int, list[memoryview]]]:
    """A window's buffers in spans of ``step`` bytes: (file offset, end, buffers)."""
    part: list[memoryview] = []
    size = 0
    for view in views:
        while len(view):
            take = view[:step - size]
            part.append(take)
            size += len(take)
            view = view[len(take):]
            if size == step:
                yield start, start + size, part
                start, part, size = start + size, [], 0
    if part:
        yield start, start + size, part


def _read_piece(fd: int, views: list[memoryview], offset: int) -> None:
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            raise EOFError(f"blob ended {sum(len(v) for v in views)} bytes early")
        offset += n
        while n and views:  # drop what was filled, keep the rest of a part-filled buffer
            if n >= len(views[0]):
                n -= len(views[0])
                views = views[1:]
            else:
                views = [views[0][n:], *views[1:]]
                n = 0
