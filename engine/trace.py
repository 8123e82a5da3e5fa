"""Routing traces: which experts each token was routed to, per MoE layer, as JSON lines.

The format (``cachecd-trace`` version 1), one JSON object per line:

    {"format": "cachecd-trace", "version": 1, "model": "org/name" | null, "created": 1718000000.0}
    {"step": 0, "layer": 1, "experts": [[3, 17, 5, 9], [3, 2, 30, 11], ...]}
    {"step": 0, "layer": 2, "experts": [[...], ...]}
    {"step": 1, "layer": 1, "experts": [[12, 3, 7, 1]]}

The first line is the header. Every other line is one MoE layer call: ``step`` counts forward
passes (a prefill chunk or one decoded token), ``layer`` is the model's layer number (the
manifest's), and ``experts`` holds one row per token with that token's routed expert ids, in the
router's order. A reader uses the counts (how often each (layer, expert) was routed to); replay
tools can use the order. Lines are flushed at every step, so an interrupted run leaves a
readable trace of every step it finished.

Invariant: recording observes the routing only; it never changes which experts are used.
This module imports no MLX, so the coverage tools can read traces without the engine.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
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

    Keeps the counts in memory (``trace``) and, given a path, writes the JSON-lines file.
    """

    def __init__(self, path: str | Path | None = None, model: str | None = None) -> None:
        self.trace = Trace(model=model)
        self._mu = threading.Lock()
        self._last_layer: int | None = None
        self._step = 0
        self._file: IO[str] | None = None
        if path is not None:
            # Open for the recorder's lifetime; close() (or exit) ends it.
            self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115
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


def read_trace(path: str | Path) -> Trace:
    """The counts of a trace file; ``InvalidRequest`` naming the line if it is not one."""
    trace = Trace()
    steps: set[int] = set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = _parse(path, number, line)
            if number == 1:
                _check_header(path, record)
                trace.model = record.get("model")
                continue
            try:
                layer, rows = int(record["layer"]), np.asarray(record["experts"], dtype=np.int64)
            except (KeyError, TypeError, ValueError):
                raise InvalidRequest(f"{path}:{number}: a trace line needs layer and experts "
                                     "(a list of per-token id lists)") from None
            trace.add(layer, rows)
            trace.tokens += rows.shape[0] if rows.ndim > 1 else 1
            steps.add(int(record.get("step", 0)))
    trace.steps = len(steps)
    return trace


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
