"""Routing traces: which experts each token was routed to, per MoE layer, as JSON lines.

The format (``cachecd-trace`` version 1), one JSON object per line:

    {"format": "cachecd-trace", "version": 1, "model": "org/name" | null, "created": 1718000000.0}
    {"step": 0, "layer": 1, "experts": [[3, 17, 5, 9], [3, 2, 30, 11], ...]}
    {"step": 0, "layer": 2, "experts": [[...], ...]}
    {"step": 1, "layer": 1, "experts": [[12, 3, 7, 1]]}

The first line is a header. Every other line is one MoE layer call: ``step`` counts forward
passes (a prefill chunk or one decoded token), ``layer`` is the model's layer number (the
manifest's), and ``experts`` holds one row per token with that token's routed expert ids, in the
router's order. A reader uses the counts (how often each (layer, expert) was routed to); replay
tools can use the order. Lines are flushed at every step, so an interrupted run leaves a
readable trace of every step it finished.

A recording into an existing trace (``cachecd run --trace``, ``CACHECD_TRACE``) appends: a new
header line, then that run's steps, counted from 0 again. A reader takes each header as the
start of another run and sums the runs; every run of a file must be of the same model. A last
line cut short by a killed run is dropped before appending. Readers also take gzip files
(``.gz``, told by their first bytes): compress a finished trace with ``gzip``; recording goes to
plain files only.

Invariant: recording observes the routing only; it never changes which experts are used.
This module imports no MLX, so the coverage tools can read traces without the engine.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from cachecd.errors import InvalidRequest

TRACE_FORMAT = "cachecd-trace"
TRACE_VERSION = 1


@dataclass
class Trace:
    model: str | None = None
    steps: int = 0
    tokens: int = 0  # token rows, summed over layer calls
    counts: Counter[tuple[int, int]] = field(default_factory=Counter)

    def add(self, layer: int, routed: np.ndarray) -> None:
        flat = np.asarray(routed).reshape(-1)
        ids, n = np.unique(flat, return_counts=True)
        for e, c in zip(ids.tolist(), n.tolist(), strict=True):
            self.counts[(layer, int(e))] += int(c)


class TraceRecorder:
    """Called as ``recorder(layer, routed)`` by the streamed bank once per MoE layer call.

    Keeps the counts of this recording in memory (``trace``) and, given a path, writes the
    JSON-lines file: over it, or with ``append`` after the runs already in it (which must be of
    the same model; ``InvalidRequest`` before anything is written otherwise).
    """

    def __init__(self, path: str | Path | None = None, model: str | None = None, *,
                 append: bool = False) -> None:
        self.trace = Trace(model=model)
        self._mu = threading.Lock()
        self._last_layer: int | None = None
        self._step = 0
        self._file: IO[str] | None = None
        if path is not None:
            if str(path).endswith(".gz"):
                raise InvalidRequest(f"{path}: traces are recorded as plain JSON lines; gzip one "
                                     "once it is finished (warm and coverage read .gz files)")
            if append:
                _ready_to_append(Path(path), model)
            # Open for the recorder's lifetime; close() (or exit) ends it.
            self._file = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115
            header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "model": model,
                      "created": round(time.time(), 3)}
            self._file.write(json.dumps(header) + "\n")
            self._file.flush()

    def __call__(self, layer: int, routed: np.ndarray) -> None:
        arr = np.asarray(routed)
        rows = arr.reshape(-1, arr.shape[-1]) if arr.ndim else arr.reshape(1, 1)
        with self._mu:
            if self._last_layer is not None and layer <= self._last_layer:
                self._step += 1  # back to an earlier layer: a new forward pass
                if self._file is not None:
                    self._file.flush()
            self._last_layer = layer
            self.trace.add(layer, rows)
            self.trace.tokens += rows.shape[0]
            self.trace.steps = self._step + 1
            if self._file is not None:
                line = {"step": self._step, "layer": int(layer), "experts": rows.tolist()}
                self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._mu:
            if self._file is not None:
                self._file.close()
                self._file = None


def _ready_to_append(path: Path, model: str | None) -> None:
    """Check that ``path`` (if it holds anything) is a trace of ``model``, and drop a last line
    cut short by a killed run, so that what is appended starts on a line of its own."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "rb") as f:
        first = f.readline()
    if first[:2] == _GZIP_MAGIC:
        raise InvalidRequest(f"{path} is gzip-compressed: record into a plain file")
    header = _parse(path, 1, first.decode("utf-8", errors="replace"))
    _check_header(path, header)
    if model is not None and header.get("model") not in (None, model):
        raise InvalidRequest(f"{path} is a trace of {header.get('model')}, not {model}: record "
                             "into another file")
    with open(path, "r+b") as f:
        f.seek(size - 1)
        if f.read(1) != b"\n":  # a torn last line: cut it back to the last whole one
            f.truncate(_last_line_end(f, size))


def _last_line_end(f: IO[bytes], size: int, chunk: int = 1 << 16) -> int:
    """The offset just past the last newline of ``f`` (0 if it has none), read from the end
    backwards, so a long trace is not read whole to drop a torn line."""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        f.seek(start)
        i = f.read(end - start).rfind(b"\n")
        if i >= 0:
            return start + i + 1
        end = start
    return 0


_GZIP_MAGIC = b"\x1f\x8b"


def _open_text(path: str | Path) -> IO[str]:
    """A trace for reading, plain or gzip (told by its first bytes, not its name)."""
    with open(path, "rb") as f:
        gz = f.read(2) == _GZIP_MAGIC
    if gz:
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_trace(path: str | Path) -> Trace:
    """The counts of a trace file, every run in it summed; ``InvalidRequest`` naming the line if
    it is not one."""
    trace = Trace()
    steps: set[tuple[int, int]] = set()
    run = -1
    try:
        with _open_text(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if not line.endswith("\n"):  # the last line: a killed run may have cut it
                    try:
                        record = _parse(path, number, line)
                    except InvalidRequest:
                        break
                else:
                    record = _parse(path, number, line)
                if number == 1 or "format" in record:
                    run += 1
                    _check_header(path, record)
                    trace.model = _same_model(path, number, trace.model if run else None,
                                              record.get("model"))
                    continue
                try:
                    layer = int(record["layer"])
                    rows = np.asarray(record["experts"], dtype=np.int64)
                except (KeyError, TypeError, ValueError):
                    raise InvalidRequest(f"{path}:{number}: a trace line needs layer and experts "
                                         "(a list of per-token id lists)") from None
                trace.add(layer, rows)
                trace.tokens += rows.shape[0] if rows.ndim > 1 else 1
                steps.add((run, int(record.get("step", 0))))
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # a gzip file cut short, binary
        if isinstance(exc, FileNotFoundError):
            raise InvalidRequest(f"{path}: no such trace file") from None
        raise InvalidRequest(f"{path}: cannot be read as a trace ({exc})") from None
    trace.steps = len(steps)
    return trace


def read_calls(path: str | Path) -> list[tuple[int, np.ndarray]]:
    """Every layer call of a trace file in order, as (layer, rows: tokens x routed ids), runs one
    after another (what a replay of the workload through a cache needs; ``read_trace`` keeps
    only the counts)."""
    calls: list[tuple[int, np.ndarray]] = []
    with _open_text(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip() or not line.endswith("\n") and calls and not _whole(line):
                continue  # blank, or a last line a killed run cut short
            record = _parse(path, number, line)
            if number == 1 or "format" in record:
                _check_header(path, record)
                continue
            try:
                rows = np.asarray(record["experts"], dtype=np.int64)
                calls.append((int(record["layer"]), rows.reshape(-1, rows.shape[-1] if rows.ndim
                                                                 else 1)))
            except (KeyError, TypeError, ValueError, IndexError):
                raise InvalidRequest(f"{path}:{number}: a trace line needs layer and experts "
                                     "(a list of per-token id lists)") from None
    return calls


def _whole(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


def read_traces(paths: Sequence[str | Path]) -> Trace:
    """Several trace files read as one workload: their counts, steps and tokens summed. They
    must be traces of the same model."""
    total = Trace()
    for i, path in enumerate(paths):
        one = read_trace(path)
        total.model = _same_model(path, 1, total.model if i else None, one.model)
        total.counts.update(one.counts)
        total.steps += one.steps
        total.tokens += one.tokens
    return total


def _same_model(path: str | Path, number: int, seen: str | None, got: str | None) -> str | None:
    if seen is not None and got is not None and seen != got:
        raise InvalidRequest(f"{path}:{number}: a trace of {got} among traces of {seen}: "
                             "give the traces of one model")
    return seen if got is None else got


def _parse(path: str | Path, number: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{path}:{number}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise InvalidRequest(f"{path}:{number}: each trace line must be a JSON object")
    return record


def _check_header(path: str | Path, header: dict[str, Any]) -> None:
    if header.get("format") != TRACE_FORMAT or header.get("version") != TRACE_VERSION:
        raise InvalidRequest(f"{path}: not a {TRACE_FORMAT} v{TRACE_VERSION} file (record one with "
                             "`cachecd run --trace FILE` or CACHECD_TRACE=FILE)")
