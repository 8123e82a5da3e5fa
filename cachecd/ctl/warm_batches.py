"""The batches of ``cachecd warm``: requests of one layer each, ``parallel`` in flight to the
daemon's ``warm`` route, with a progress bar, a line while none is answered, and Ctrl-C that stops
new requests and counts those the daemon is answering (their fetches land anyway).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachecd.errors import CachecdError

log = logging.getLogger(__name__)

RETRIES = 3
RETRY_CODES = frozenset({"reservations_full", "too_many_connections", "shutting_down"})
WAIT_NOTICE_S, WAIT_REPEAT_S = 3.0, 10.0


@dataclass
class Batch:
    layer: int
    experts: list[int]
    nbytes: int


@dataclass
class Outcome:
    fetched: int = 0
    fetched_bytes: int = 0
    done_batches: int = 0
    error: CachecdError | None = None
    interrupted: bool = False


def plan_batches(layer_ids: np.ndarray, expert_ids: np.ndarray, sizes: np.ndarray,
                 rows: np.ndarray, max_experts: int = 16, window: int = 256) -> list[Batch]:
    """Requests of one layer each, in priority order: rows are taken ``window`` at a time and
    grouped by layer inside a window, so an interrupted run has fetched the most wanted."""
    batches: list[Batch] = []
    for start in range(0, len(rows), window):
        chunk = rows[start:start + window]
        by_layer: dict[int, list[int]] = {}
        for r in chunk.tolist():
            by_layer.setdefault(int(layer_ids[r]), []).append(r)
        for layer, members in by_layer.items():
            for i in range(0, len(members), max_experts):
                part = members[i:i + max_experts]
                batches.append(Batch(layer, [int(expert_ids[r]) for r in part],
                                     int(sizes[part].sum())))
    return batches


@contextmanager
def interrupt_flag() -> Iterator[threading.Event]:
    """Ctrl-C sets a flag the batch loop reads between its waits, instead of raising inside them.

    A KeyboardInterrupt that lands inside ``concurrent.futures.wait`` while it holds the futures'
    locks leaves one held; the worker that then finishes that future waits for it forever, and the
    interpreter, joining its workers at exit, with it."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, lambda _sig, _frame: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


# The bar keeps a width of its own: tqdm would shrink it to one character to fit a long
# postfix (warm --prompts' layer line), which is cut at the terminal's edge instead.
BAR_FORMAT = "{l_bar}{bar:24}{r_bar}"


def run_batches(make_client: Callable[[], Any], model: str, batches: list[Batch], total: int,
                parallel: int) -> Outcome:
    """Send the batches to the daemon (``parallel`` in flight), with a bytes progress bar. On
    Ctrl-C no new batch starts, and those the daemon is answering are waited for and counted
    (a second Ctrl-C leaves at once: they still land in the cache)."""
    from huggingface_hub.utils import tqdm  # honours HF_HUB_DISABLE_PROGRESS_BARS

    outcome = Outcome()
    local = threading.local()
    clients: list[Any] = []
    lock = threading.Lock()

    def send(batch: Batch) -> dict[str, Any]:
        if not hasattr(local, "client"):
            local.client = make_client()
            with lock:
                clients.append(local.client)
        return _send_with_retries(local.client, model, batch)

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="warm",
               disable=None, file=sys.stderr, bar_format=BAR_FORMAT)
    pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="cachecd-warm")
    try:
        with interrupt_flag() as interrupted:
            pending = {pool.submit(send, b): b for b in batches}
            _collect(pending, outcome, bar, interrupted)
            outcome.interrupted = interrupted.is_set()
        if outcome.interrupted:
            _finish_in_flight(pending, outcome, bar)
    except KeyboardInterrupt:  # before the flag took over Ctrl-C
        outcome.interrupted = True
    finally:
        pool.shutdown(wait=not outcome.interrupted, cancel_futures=True)
        bar.close()
        for c in clients:
            c.close()
    return outcome


def _finish_in_flight(pending: dict[Future[dict[str, Any]], Batch], outcome: Outcome,
                      bar: Any) -> None:
    """After Ctrl-C: what the daemon is already fetching lands anyway; count it."""
    running = {f: b for f, b in pending.items() if not f.cancel()}
    if not running:
        return
    print(f"interrupted: waiting for the {len(running)} requests the daemon is answering "
          "(Ctrl-C again to leave now; they land in the cache all the same)", file=sys.stderr)
    with interrupt_flag() as again:
        _collect(running, outcome, bar, again)


def _collect(pending: dict[Future[dict[str, Any]], Batch], outcome: Outcome, bar: Any,
             interrupted: threading.Event) -> None:
    quiet_since = time.monotonic()
    waited = WaitNotice()
    while pending and not interrupted.is_set():
        # A timeout so Ctrl-C is seen promptly.
        done, _ = wait(list(pending), timeout=0.2, return_when=FIRST_COMPLETED)
        if not done:
            waited.tick(time.monotonic() - quiet_since, len(pending))
            continue
        quiet_since, waited = time.monotonic(), WaitNotice()
        for fut in done:
            batch = pending.pop(fut)
            try:
                answer = fut.result()
            except CachecdError as exc:
                outcome.error = exc
                for other in pending:
                    other.cancel()
                return
            outcome.fetched += int(answer["fetched"])
            outcome.fetched_bytes += int(answer["fetched_bytes"])
            outcome.done_batches += 1
            bar.update(batch.nbytes)


class WaitNotice:
    """A line on stderr while no answer comes (a slow or faulty Hub: the daemon retries it), so
    a warm that waits says so, bar or no bar: after WAIT_NOTICE_S, then every WAIT_REPEAT_S."""

    def __init__(self) -> None:
        self.next = WAIT_NOTICE_S

    def tick(self, quiet: float, to_go: int) -> None:
        if quiet < self.next:
            return
        self.next = quiet + WAIT_REPEAT_S
        print(f"still waiting for the daemon: no answer for {quiet:.0f} s, {to_go} requests to "
              "go (it is fetching from its peers or the Hub and retries their faults; "
              "`cachecd status` and its log say which)", file=sys.stderr, flush=True)


def _send_with_retries(client: Any, model: str, batch: Batch) -> dict[str, Any]:
    for attempt in range(RETRIES + 1):
        try:
            return client.warm(model, batch.layer, batch.experts)
        except CachecdError as exc:
            # The daemon retried the Hub's faults already; asking again would only multiply its
            # retries. What frees up on the daemon's side soon (room, connections) is retried.
            if exc.code not in RETRY_CODES or attempt == RETRIES:
                raise
            log.info("warm batch retry layer=%d code=%s attempt=%d", batch.layer, exc.code, attempt + 1)
            time.sleep(2 ** attempt)
    raise AssertionError("unreachable")
