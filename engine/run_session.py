"""One ``cachecd run``: the ``load`` and ``generate`` that mlx_lm.generate's ``main()`` calls
(``run_mlx``), and what the run shows: the text as it comes, the cold cache's cost before a
prefill, a long prefill's progress, the waits on the Hub, ``--stats`` lines, the summary or JSON.

Where stdout and stderr are one file (a terminal, or ``2>&1``), a line on stderr that comes in
the middle of the text starts a line of its own (``Terminal``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from cachecd.sizes import format_size


def cold_cost_notice(client: Any, repo: str) -> str:
    cov = client.coverage(repo)
    missing = cov["bytes_total"] - cov["bytes_cached"]
    if not missing:
        return f"cache: every expert of {repo} is local"
    return (f"cache: {format_size(cov['bytes_cached'])} of {format_size(cov['bytes_total'])} of experts "
            f"are local; a long prefill can route to any expert, so up to {format_size(missing)} may "
            f"be fetched first (warm it ahead: cachecd warm)")


class PrefillProgress:
    """mlx-lm's ``prompt_progress_callback``: a stderr line after each step of a prefill longer
    than one step (after each layer when it runs layer by layer: ``prefill_progress``), with the
    experts read through the daemon and fetched from the Hub so far."""

    def __init__(self, stats: Any, client: Any, step: int, prefix: str = "") -> None:
        from cachecd_engine.prefill_progress import LayerFigures

        self.stats, self.client, self.step, self.prefix = stats, client, step, prefix
        self.deferral: Any = None  # the model's, when its prefill runs layer by layer
        self.t0 = time.perf_counter()
        self.fetched0 = client.upstream_fetches
        self.figures = LayerFigures(stats, client)

    def __call__(self, done: int, total: int) -> None:
        # A held-back step has not run yet; during a pass the layer lines say where it is.
        busy = self.deferral is not None and (self.deferral.held or self.deferral.running)
        if total <= self.step or done == 0 or busy:
            return
        s = self.stats
        print(f"{self.prefix}prefill {done}/{total} tokens: {s.source_hits} experts read "
              f"through the daemon ({format_size(s.source_bytes)}), "
              f"{self.client.upstream_fetches - self.fetched0} fetched from the Hub, "
              f"{time.perf_counter() - self.t0:.1f} s", file=sys.stderr, flush=True)

    def layer(self, done: int, layers: int) -> None:
        """A layer-by-layer prefill (``prefill_defer``): a line after each layer."""
        if done == 0:
            self.figures.start()
        else:
            print(self.prefix + self.figures.line(done, layers), file=sys.stderr, flush=True)


class Terminal:
    """The text on stdout and notices on stderr: where both are one file (a terminal, or
    ``2>&1``), a notice that comes mid-text starts a line of its own."""

    def __init__(self) -> None:
        import os

        try:
            self.shared = os.path.samestat(os.fstat(sys.stdout.fileno()),
                                           os.fstat(sys.stderr.fileno()))
        except (OSError, ValueError):  # a stream without a file (captured in a test)
            self.shared = False
        self.mid_line = False

    def text(self, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()
        if piece:
            self.mid_line = not piece.endswith("\n")

    def line(self, message: str) -> None:
        lead = "\n" if self.shared and self.mid_line else ""
        self.mid_line = False
        print(lead + message, file=sys.stderr, flush=True)


class RunSession:
    """One ``cachecd run``: the ``load`` and ``generate`` mlx_lm.generate's main() calls, and
    what the run shows. ``--verbose F``: only the answer (main() prints it); ``--json``: the JSON
    on stdout; a pipelined rank other than 0 prints no text, only its own notices."""

    def __init__(self, args: argparse.Namespace, group: Any, load: Callable[..., Any],
                 engine: dict[str, Any]) -> None:
        from cachecd_engine.pool.bank import EngineStats

        self.args, self.group, self.stats = args, group, EngineStats()
        self._load, self.engine = load, engine
        self.prefix = f"rank {group.rank()}: " if group is not None else ""
        self.quiet = group is not None and group.rank() != 0
        # Every rank says its own notices (prefixed); rank 0 alone prints the text.
        self.chatty = bool(args.verbose)
        self.streams = self.chatty and not args.json and not self.quiet
        self.terminal = Terminal()
        self.model: Any = None
        self.records: list[dict[str, Any]] = []
        self.last: Any = None
        self.compiling: str | None = None  # said once, after the cold cache's cost

    def main_args(self) -> argparse.Namespace:
        """``args`` for main(), whose ``verbose`` says whether it prints the answer itself."""
        prints = not self.args.verbose and not self.args.json and not self.quiet
        return argparse.Namespace(**{**vars(self.args), "verbose": not prints})

    def load(self, path: str, adapter_path: str | None = None,
             tokenizer_config: dict[str, Any] | None = None,
             model_config: dict[str, Any] | None = None, return_config: bool = False,
             trust_remote_code: bool = False) -> Any:
        a = self.args
        model, tokenizer, config = self._load(
            path, stats=self.stats, trace=a.trace, pipeline=self.group or False,
            trust_remote_code=trust_remote_code, adapter_path=adapter_path,
            tokenizer_config=tokenizer_config, model_config=model_config, return_config=True,
            **self.engine)
        self.model = model
        return (model, tokenizer, config) if return_config else (model, tokenizer)

    def generate(self, model: Any, tokenizer: Any, prompt: list[int], verbose: bool = False,
                 **options: Any) -> str:
        """The text of ``stream_generate(model, tokenizer, prompt, **options)``, as mlx-lm's
        ``generate`` returns it; streamed to stdout as it comes unless main() prints it."""
        if self.chatty:
            client = model.bank.source.client
            self.terminal.line(self.prefix + cold_cost_notice(client, self.args.model))
            if self.compiling is not None:
                self.terminal.line(self.prefix + self.compiling)
                self.compiling = None
        self.records, self.last = self._generate(model, tokenizer, prompt, options)
        return "".join(r["text"] for r in self.records)

    def close(self) -> None:
        if self.model is None:
            return
        bank_source = self.model.bank.source
        self.model.bank.close()
        bank_source.close()
        if self.model.bank.trace is not None:
            self.model.bank.trace.close()

    def _generate(self, model: Any, tokenizer: Any, prompt: list[int],
                  options: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
        from mlx_lm import stream_generate

        from cachecd_engine.prefill_progress import wait_line, watch

        a, stats, say = self.args, self.stats, self.terminal.line
        client = model.bank.source.client
        if self.chatty:
            progress = PrefillProgress(stats, client, options["prefill_step_size"], self.prefix)
            if watch(model, progress.layer):
                progress.deferral = model.deferral
            options["prompt_progress_callback"] = progress
        if self.chatty and not self.quiet:  # a cold layer's wait on the Hub, about once a second
            client.on_wait(lambda p: say(self.prefix + wait_line(p)))
        records: list[dict[str, Any]] = []
        t0, last, fetched = time.perf_counter(), None, client.upstream_fetches
        try:
            for resp in stream_generate(model, tokenizer, prompt, **options):
                now = time.perf_counter()
                step = {"token": int(resp.token), "text": resp.text, "s": round(now - t0, 6),
                        "logprob": float(resp.logprobs[resp.token].item()),  # type: ignore[arg-type]
                        **stats.snapshot(), "fetched_upstream": client.upstream_fetches - fetched}
                fetched = client.upstream_fetches
                stats.reset()
                t0, last = now, resp
                records.append(step)
                if self.streams:
                    self.terminal.text(resp.text)
                if a.stats and not a.json:
                    say(self.prefix + _stat_line(len(records), step))
        except BaseException:  # Ctrl-C or an error mid-text: the text's line ends before the error
            if records and self.streams:
                print(flush=True)
            raise
        return records, last

    def summary(self, records: list[dict[str, Any]]) -> None:
        a, last = self.args, self.last
        if a.json:
            print(json.dumps({"model": a.model, "tokens": [r["token"] for r in records],
                              "text": "".join(r["text"] for r in records), "per_token": records,
                              "prompt_tps": last.prompt_tps if last else 0.0,
                              "generation_tps": last.generation_tps if last else 0.0}))
            return
        if not self.streams:
            return  # --verbose F: main() printed the answer, and only that
        print()
        if last is not None:
            print(f"prompt {last.prompt_tokens} tokens at {last.prompt_tps:.1f} tok/s, generated "
                  f"{last.generation_tokens} at {last.generation_tps:.1f} tok/s", file=sys.stderr)


def _stat_line(i: int, s: dict[str, Any]) -> str:
    return (f"token {i}: routed {s['experts_routed']} RAM hits {s['ram_hits']} read ahead "
            f"{s['staged_hits']} daemon {s['source_hits']} of which fetched upstream "
            f"{s['fetched_upstream']} ({format_size(s['source_bytes'])}) waited for experts "
            f"{s['wait_s'] * 1000:.1f} ms total {s['s'] * 1000:.1f} ms")
