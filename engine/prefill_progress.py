"""Prefill progress in layer order: a layer-by-layer prefill's figures (``prefill_defer``'s
``on_layer``) as one line: layers done of all, experts read through the daemon and fetched from
the Hub, bytes, seconds, rate and time left.

``cachecd run`` prints the line after each layer; ``cachecd warm --prompts`` shows it beside its
bar (a bar on a terminal only, as its bar); ``cachecd openai`` logs it (``LayerLog``: the first
and the last layer of a pass, and at most one line every ``LOG_EVERY_S`` between).

Between those lines a layer's read can wait on the Hub for long (a cold prompt's first layers:
tens of seconds); ``wait_line`` says how that wait goes (the daemon client's ``on_wait``, about
once a second): experts fetched of those under way, bytes, rate and time left. ``run`` prints
it, ``warm --prompts`` shows it beside its bar, ``cachecd openai`` logs it (``log_wait``: a
cold request's first token is slow for that, and its log says so while it lasts).

Invariants:
- The figures are differences from the pass's start (``on_layer(0, layers)``): nothing here
  resets the engine's counters (the server's per-request views read the same ones).
- A line reports and never raises into the pass for want of a figure: an engine without a
  daemon client counts no fetches.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cachecd.sizes import format_size

log = logging.getLogger(__name__)

LOG_EVERY_S = 5.0  # the server's log: one line at most this often between a pass's first and last


class LayerFigures:
    """The engine's counters (``EngineStats``) and its daemon client's fetches since a pass
    started."""

    def __init__(self, stats: Any, client: Any) -> None:
        self.stats, self.client = stats, client
        self.start()

    def _fetched(self) -> int:
        return int(getattr(self.client, "upstream_fetches", 0))

    def start(self) -> None:
        s = self.stats
        self.t0, self.hits0, self.bytes0 = time.perf_counter(), s.source_hits, s.source_bytes
        self.fetched0 = self._fetched()
        self.last = (self.t0, 0, s.source_hits)  # (when, layers done, hits) at the last line
        self.reading: tuple[float, int] | None = None  # when the first layer that read began

    def line(self, done: int, layers: int) -> str:
        now = time.perf_counter()
        took = now - self.t0
        nbytes = self.stats.source_bytes - self.bytes0
        rate = nbytes / took if took > 0 else 0.0
        return (f"prefill layer {done}/{layers}: {self.stats.source_hits - self.hits0} experts "
                f"read through the daemon ({format_size(nbytes)}), "
                f"{self._fetched() - self.fetched0} fetched from the Hub, {took:.1f} s, "
                f"{format_size(int(rate))}/s, {self._left(now, done, layers)}")

    def _left(self, now: float, done: int, layers: int) -> str:
        """Time left, from the layers since the first one that read experts began: layers
        before it (a dense layer, MLX compiling its kernels on a first run) say nothing of
        the rest, so until one has read there is no estimate."""
        then, done_then, hits_then = self.last
        self.last = (now, done, self.stats.source_hits)
        if self.reading is None and self.stats.source_hits > hits_then:
            self.reading = (then, done_then)
        if self.reading is None or done <= self.reading[1]:
            return "time left not known yet"
        since, base = self.reading
        return f"about {(now - since) / (done - base) * (layers - done):.0f} s left"


class LayerLog:
    """``on_layer`` for the server: its log's line for a pass (INFO), the first and the last
    layer always, one every ``LOG_EVERY_S`` at most between (K3's 92 layers would be 92 lines
    a prompt; a pass of a few seconds says where it is once)."""

    def __init__(self, stats: Any, client: Any, prefix: str = "") -> None:
        self.figures, self.prefix = LayerFigures(stats, client), prefix
        self.last = 0.0

    def __call__(self, done: int, layers: int) -> None:
        now = time.monotonic()
        if done == 0:
            self.figures.start()
            return
        if done in (1, layers) or now - self.last >= LOG_EVERY_S:
            self.last = now
            log.info("%s%s", self.prefix, self.figures.line(done, layers))


class LayerPostfix:
    """``on_layer`` for ``cachecd warm --prompts``: the line beside its bar of prompts (tqdm's
    postfix: nothing where the bar is off, off a terminal)."""

    def __init__(self, stats: Any, client: Any, bar: Any) -> None:
        self.figures, self.bar = LayerFigures(stats, client), bar
        self.prompt = 0  # the prompt being prefilled, from 1

    def __call__(self, done: int, layers: int) -> None:
        if done == 0:
            self.figures.start()
        else:
            self.bar.set_postfix_str(f"prompt {self.prompt}: {self.figures.line(done, layers)}")

    def wait(self, progress: Any) -> None:
        """The daemon client's ``on_wait``: a layer's wait on the Hub, beside the bar."""
        self.bar.set_postfix_str(f"prompt {self.prompt}: {wait_line(progress)}")


def wait_line(p: Any) -> str:
    """A read waiting on the daemon (``cachecd_client.waits.WaitProgress``), as one line."""
    left = f"about {p.left_s:.0f} s left" if p.left_s is not None else "no byte in yet"
    return (f"layer {p.layer}: waiting {p.waited_s:.0f} s on the daemon for {p.routed} experts "
            f"routed: {p.fetched} of {p.fetched + p.fetching} fetched from the Hub "
            f"({format_size(p.fetched_bytes)} of {format_size(p.fetched_bytes + p.fetching_bytes)}), "
            f"{format_size(int(p.rate))}/s, {left}")


def log_wait(p: Any) -> None:
    """The daemon client's ``on_wait`` for the server: a layer's wait on the Hub in its log
    (INFO), as often as the client's watcher calls it (about once a second while a read waits)."""
    log.info("%s", wait_line(p))


def watch(model: Any, on_layer: Any) -> bool:
    """Set ``on_layer`` on ``model``'s deferral (``generate_step``'s prefill) and its
    ``BatchGenerator`` prefill (``ahead``) where they run layer by layer."""
    watched = False
    for name in ("deferral", "ahead"):
        part = getattr(model, name, None)
        if part is not None and part.on:
            part.on_layer = on_layer
            watched = True
    return watched


class LoopProgress:
    """Stands in for ``generate_step``'s ``prompt_progress_callback`` while the loop's steps are
    held back (``prefill_defer``): a held step has done no work, so the loop's report after it
    is not passed on; during the pass the callback hears, after each layer, the tokens that
    fraction of the pass stands for, so what it hears rises steadily from the tokens before the
    held steps to those after them (not the last held step's figure at once, then again each
    layer); once the pass is over, the loop's own reports pass through."""

    def __init__(self, callback: Any, start: int, total: int) -> None:
        self.callback, self.start, self.end, self.total = callback, start, start, total
        self.holding = False  # steps are held: the loop's reports are not passed on

    def __call__(self, done: int, total: int) -> None:
        if not self.holding:
            self.callback(done, total)

    def layer(self, done: int, layers: int) -> None:
        """After layer ``done`` of the pass over the held steps."""
        if done > 0:
            self.callback(self.start + (self.end - self.start) * done // layers, self.total)


def set_local(frame: Any, name: str, value: Any) -> bool:
    """Rebind a local of a running function's ``frame`` (the loop's callback, which it calls by
    that name); False where this Python cannot."""
    import sys

    frame.f_locals[name] = value  # from Python 3.13 (PEP 667) this writes through
    if sys.version_info >= (3, 13):
        return True
    import ctypes

    try:  # before 3.13 the frame's fast locals take the dict back only when told
        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))
    except (AttributeError, OSError):
        return False
    return frame.f_locals.get(name) is value
