"""Eviction policies against Belady's optimum on routing traces, scored on held-out requests.

Traces (bench/traces.py):
  engine-*   the tiny K3-architecture model (random weights, byte tokens) run in-process through
             the streamed engine, routing recorded with ``TraceRecorder``; 24 prompts warm the
             cache, 24 OTHER prompts are scored. Two sizes: 5 MoE layers x 32 experts and
             7 x 64, top-4, each prompt followed by ``--max-new`` greedy tokens.
  synth-*    scaled K3 (16 layers x 256 experts, top-8): per-layer Zipf popularity that drifts
             (topic changes reshuffle part of each ranking), bursty sequences (a sequence favours
             some experts), a prefill call per layer then token-by-token decoding; the first
             40% warms, the rest is scored. synth-k3 is skewed (s 0.8-1.2), synth-flat less so
             (s 0.5-0.8) with faster drift.
  --trace F  any recorded ``cachecd-trace`` file, cut in time (``--train-frac``).

Each trace is scored in two views. ``token`` (the issue's definition): one request per (token,
routed expert), in the engine's order. ``call`` (what the daemon sees): the engine fetches a
layer call's distinct experts together, so an expert is one request per layer call; decoding
is the same in both views, a prefill call differs.

Policies are the real classes: LRU and the default from cachecd.store.policies, LFU (LFU-DA with
aging held at 0), replayed as the store drives them (bench/policy_sim.py); Belady is MIN on the
scored requests from the best possible starting content, an upper bound for every policy. The
cache holds 10%, 25% and 50% of the expert set. ``fixed*`` is the best FIXED set of that size
in hindsight (the most used experts of the scored part).

More columns say how much of Belady any online policy could reach. ``A0*`` evicts the
cached expert used least in the scored part (it knows how often, not when): the best online
policy when requests are independent draws. ``Belady~`` is Belady on the scored calls in a
random order (``Stream.shuffled``: each layer's calls shuffled among that layer's places).
A row is order-free when its calls hold distinct experts (the per-call view) and Belady~ >=
Belady: the order of the calls holds nothing, the requests are close to independent draws,
and A0*/Belady is about the best ratio an online policy can expect there. (In the token view a
prefill call repeats its experts, which recency exploits and A0 does not: A0* is no ceiling
there.) ``now*`` (synthetic traces only) knows the distribution each request is drawn from
at the moment it is drawn (every topic change and each sequence's favoured experts) and evicts
the cached expert least likely under it: A0 told every change at once, which no policy is.

``ceiling/Belady`` is about the most an online policy can expect, relative to Belady: on a
per-call row the higher of A0* (if order-free) and now* (if synthetic); on a token row, Belady's
own hits on the repeats inside calls plus the per-call ceiling's hits on the calls' first
requests (``online_ceiling``); ``-`` where nothing is known. The closing lines list the rows
below 0.9 x Belady whose ceiling is below 0.9 too.

Last line: ``ratio=X``, the worst default/Belady over all rows (the bar is 0.9).

    python bench/policy_eval.py [--tokens 6000] [--max-new 32] [--jobs 2] [--views token,call]
                                [--trace FILE ...] [--train-frac 0.5] [--no-engine] [--markdown]
                                [--also lfuda] [--no-daemon-touch]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from policy_sim import LFU, a0_hits, belady_hits, belady_mask, now_hits, replay  # noqa: E402
from traces import (  # noqa: E402
    KEY_STRIDE,
    PROMPTS,
    EngineSpec,
    Split,
    SynthSpec,
    expert_set_size,
    read_requests,
    record_engine,
    routing_skew,
    split_by_time,
    synthetic,
)

from cachecd.store.policies import LRU, EvictionPolicy, make_policy  # noqa: E402

BUDGETS = (10, 25, 50)
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "LRU": LRU,
    "LFU": LFU,
    "default": lambda: make_policy("default"),
}
ENGINES = (EngineSpec(32, 6, 4), EngineSpec(64, 8, 4))
SYNTH = (
    SynthSpec(name="synth-k3"),
    SynthSpec(
        name="synth-flat",
        zipf=(0.5, 0.8),
        drift_every=400,
        drift_frac=0.3,
        seq_len=(32, 256),
        prefill_frac=0.3,
        burst_experts=16,
        burst_boost=3.0,
        seed=1,
    ),
)

# Filled before the pool forks: workers read them, never pickle them.
_SPLITS: dict[str, Split] = {}
_SHUFFLED: dict[str, np.ndarray] = {}  # split name -> its scored calls in a random order
_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {}


@dataclass(frozen=True)
class Row:
    trace: str
    budget: int
    rates: dict[str, float]  # policy (and the bounds, fixed*, ceiling) -> hit rate, scored part
    distinct_calls: bool = False  # every call of the scored part holds distinct experts

    @property
    def order_free(self) -> bool:
        """Calls of distinct experts, and shuffling them costs Belady nothing: about independent
        draws, where A0* is the best an online policy can expect."""
        return self.distinct_calls and self.rates["Belady~"] >= self.rates["Belady"]

    @property
    def ceiling(self) -> float:
        """ceiling/Belady: the most an online policy can expect here, relative to Belady (NaN
        where the row has no ceiling; see ``online_ceiling``)."""
        c, best = self.rates["ceiling"], self.rates["Belady"]
        return c / best if best else math.nan

    @property
    def ratio(self) -> float:
        return self.rates["default"] / self.rates["Belady"] if self.rates["Belady"] else 0.0


def _job(args: tuple[str, int, str, bool]) -> list[tuple[tuple[str, int, str], float]]:
    name, budget, policy, touch = args
    split = _SPLITS[name]
    capacity = max(1, split.n_experts * budget // 100)
    if policy == "Belady":
        hit = belady_mask(split.test.keys, capacity)
        n = max(1, hit.size)
        # Belady@first: its hits on the requests that are their expert's first in a call.
        first = float(hit[split.test.first_in_call()].sum()) / n
        return [
            ((name, budget, "Belady"), float(hit.sum()) / n),
            ((name, budget, "Belady@first"), first),
        ]
    if policy == "A0*":
        score = a0_hits(split.train.keys, split.test.keys, capacity)
    elif policy == "Belady~":
        score = belady_hits(_SHUFFLED[name], capacity)
    elif policy == "now*":
        if split.dists is None or split.train.states is None or split.test.states is None:
            return [((name, budget, policy), math.nan)]  # only a generator knows its dists
        score = now_hits(
            (split.train.keys, split.train.states),
            (split.test.keys, split.test.states),
            capacity,
            split.dists,
            KEY_STRIDE,
        )
    else:
        score = replay(_POLICIES[policy], split.train.keys, split.test.keys, capacity, touch)
    return [((name, budget, policy), score.rate)]


def fixed_best(test: np.ndarray, capacity: int) -> float:
    """Hit rate of the best fixed set of ``capacity`` experts for ``test``, in hindsight."""
    _, counts = np.unique(test, return_counts=True)
    # Loaded before the first request, as Belady's starting content is.
    return float(np.sort(counts)[::-1][:capacity].sum() / test.size) if test.size else 0.0


def evaluate(
    splits: list[Split], jobs: int, also: tuple[str, ...] = (), daemon_touch: bool = True
) -> list[Row]:
    """Every policy (and ``also``: more names from cachecd.store.policies) on every split and budget."""
    _SPLITS.clear()
    _SPLITS.update({s.name: s for s in splits})
    _SHUFFLED.clear()
    _SHUFFLED.update({s.name: s.test.shuffled(np.random.default_rng(0)).keys for s in splits})
    _POLICIES.clear()
    _POLICIES.update(POLICIES)
    _POLICIES.update({name: functools.partial(make_policy, name) for name in also})
    bounds = ("Belady", "A0*", "Belady~", "now*")
    todo = [
        (s.name, b, p, daemon_touch) for s in splits for b in BUDGETS for p in (*_POLICIES, *bounds)
    ]
    # The longest jobs first so the pool's tail is short.
    todo.sort(key=lambda j: -_SPLITS[j[0]].test.keys.size - _SPLITS[j[0]].train.keys.size)
    if jobs > 1:
        with mp.get_context("fork").Pool(jobs) as pool:
            done = dict(kv for out in pool.imap_unordered(_job, todo) for kv in out)
    else:
        done = dict(kv for job in todo for kv in _job(job))
    rows = []
    for s in splits:
        distinct = bool(s.test.first_in_call().all())  # the per-call view is the same
        for b in BUDGETS:
            rates = {p: done[(s.name, b, p)] for p in (*_POLICIES, *bounds, "Belady@first")}
            rates["fixed*"] = fixed_best(s.test.keys, max(1, s.n_experts * b // 100))
            rows.append(Row(s.name, b, rates, distinct))
    online_ceiling(rows, {s.name: s for s in splits})
    return rows


def online_ceiling(rows: list[Row], splits: dict[str, Split]) -> None:
    """Fill ``rates["ceiling"]``: about the best hit rate an online policy can expect.

    - A per-call row (its calls hold distinct experts): A0* if it is order-free, now* if it is
      synthetic; the higher of the two where both apply (a drift-following policy can beat A0*
      on a synthetic row that looks order-free).
    - A token row whose per-call row has such a ceiling. Its requests are the calls' first
      requests (the per-call stream) and repeats inside a call. Granted: Belady's own hits on
      the repeats, plus on the first requests the per-call ceiling's hits (no more than
      Belady's there). Both parts are generous to an online policy.
    - Otherwise NaN: nothing known.
    """
    by_key = {(r.trace, r.budget): r for r in rows}
    for r in rows:
        if not r.distinct_calls:
            continue
        found = [r.rates["now*"]] if not math.isnan(r.rates["now*"]) else []
        if r.order_free:
            found.append(r.rates["A0*"])
        r.rates["ceiling"] = max(found) if found else math.nan
    for r in rows:
        if r.distinct_calls:
            continue
        call = by_key.get((f"{r.trace}/call", r.budget))
        r.rates["ceiling"] = math.nan
        if call is not None and not math.isnan(call.rates["ceiling"]):
            share = splits[call.trace].test.keys.size / splits[r.trace].test.keys.size
            on_first = min(call.rates["ceiling"] * share, r.rates["Belady@first"])
            r.rates["ceiling"] = r.rates["Belady"] - r.rates["Belady@first"] + on_first


HEADER = (
    "trace",
    "budget%",
    "LRU",
    "LFU",
    "default",
    "Belady",
    "default/Belady",
    "default>LRU",
    "fixed*",
    "A0*",
    "A0*/Belady",
    "Belady~",
    "now*",
    "ceiling/Belady",
)


def row_cells(r: Row, also: tuple[str, ...]) -> list[str]:
    rt = r.rates
    return [
        r.trace,
        str(r.budget),
        f"{rt['LRU']:.3f}",
        f"{rt['LFU']:.3f}",
        f"{rt['default']:.3f}",
        f"{rt['Belady']:.3f}",
        f"{r.ratio:.3f}",
        "yes" if rt["default"] > rt["LRU"] else "NO",
        f"{rt['fixed*']:.3f}",
        f"{rt['A0*']:.3f}",
        f"{rt['A0*'] / rt['Belady'] if rt['Belady'] else 0.0:.3f}",
        f"{rt['Belady~']:.3f}",
        _cell(rt["now*"]),
        _cell(r.ceiling),
        *(f"{rt[name]:.3f}" for name in also),
    ]


def _cell(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def print_table(rows: list[Row], markdown: bool, also: tuple[str, ...] = ()) -> None:
    header = [*HEADER, *also]
    cells = [header] + [row_cells(r, also) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    for c in cells:
        print(
            "  ".join(
                x.rjust(w) if i else x.ljust(w)
                for i, (x, w) in enumerate(zip(c, widths, strict=True))
            )
        )
    if markdown:
        print()
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
        for c in cells[1:]:
            print("| " + " | ".join(c) + " |")
        print()


def _engine_splits(args: argparse.Namespace, work: Path) -> list[Split]:
    train, test = list(PROMPTS[0::2]), list(PROMPTS[1::2])
    out = []
    for base in ENGINES:
        t0 = time.perf_counter()
        spec = dataclasses.replace(base, max_new=args.max_new)
        split = record_engine(spec, work, train[: args.prompts], test[: args.prompts])
        share, uniform = routing_skew(split.test.keys, spec.experts)
        print(
            f"recorded {split.describe()} in {time.perf_counter() - t0:.1f}s; routing: "
            f"each layer's top 10% experts get {share:.1%} of requests "
            f"(uniform: {uniform:.1%})",
            flush=True,
        )
        out.append(split)
    return out


def _synthetic_splits(args: argparse.Namespace) -> list[Split]:
    out = []
    for base in SYNTH:
        spec = dataclasses.replace(base, tokens=args.tokens)
        split = synthetic(spec)
        share, uniform = routing_skew(split.test.keys, spec.experts)
        print(
            f"generated {split.describe()}; routing: each layer's top 10% experts get "
            f"{share:.1%} of requests (uniform: {uniform:.1%})",
            flush=True,
        )
        out.append(split)
    return out


def build_splits(args: argparse.Namespace, work: Path) -> list[Split]:
    out = [] if args.no_engine else _engine_splits(args, work)
    out += _synthetic_splits(args)
    for path in args.trace:
        stream = read_requests(path)
        out.append(
            split_by_time(Path(path).stem, stream, args.train_frac, expert_set_size(stream.keys))
        )
    views = [v.strip() for v in args.views.split(",")]
    return [s for s in out if "token" in views] + [s.per_call() for s in out if "call" in views]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp", help="where the work dir (removed at the end) goes")
    ap.add_argument("--tokens", type=int, default=6000, help="tokens per synthetic trace")
    ap.add_argument("--max-new", type=int, default=32, help="tokens decoded after each prompt")
    ap.add_argument(
        "--prompts",
        type=int,
        default=len(PROMPTS) // 2,
        help="prompts per half (warm-up / scored) for the engine traces",
    )
    ap.add_argument("--jobs", type=int, default=2, help="worker processes for the replays")
    ap.add_argument("--views", default="token,call", help="token, call or both")
    ap.add_argument("--trace", action="append", default=[], help="a recorded cachecd-trace file")
    ap.add_argument("--train-frac", type=float, default=0.5, help="warm-up share of a --trace")
    ap.add_argument("--no-engine", action="store_true", help="skip the tiny-engine traces")
    ap.add_argument(
        "--no-daemon-touch",
        action="store_true",
        help="do not count the daemon's access right after a miss's insert",
    )
    ap.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    ap.add_argument(
        "--also", action="append", default=[], help="one more cachecd policy as a column (lfuda)"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="policy-eval-", dir=args.dir))
    try:
        splits = build_splits(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    also = tuple(args.also)
    rows = evaluate(splits, args.jobs, also, daemon_touch=not args.no_daemon_touch)
    print_table(rows, args.markdown, also)
    misses = [f"{r.trace}@{r.budget}%" for r in rows if r.ratio < 0.9]
    below = [f"{r.trace}@{r.budget}%" for r in rows if r.rates["default"] <= r.rates["LRU"]]
    print(f"below 0.9x Belady: {', '.join(misses) or 'none'}")
    print(f"default not above LRU: {', '.join(below) or 'none'}")
    bound = [f"{r.trace}@{r.budget}% {r.rates['A0*'] / r.rates['Belady']:.3f}"
             for r in rows if r.order_free and r.rates["Belady"]]  # fmt: skip
    print(f"order-free rows, A0*/Belady (about the most an online policy can expect): "
          f"{', '.join(bound) or 'none'}")  # fmt: skip
    capped = [f"{r.trace}@{r.budget}% {r.ceiling:.3f}" for r in rows
              if r.ratio < 0.9 and r.ceiling < 0.9]  # fmt: skip
    print(f"below 0.9x Belady with an online ceiling below 0.9 too ({len(capped)} of "
          f"{len(misses)}): {', '.join(capped) or 'none'}")  # fmt: skip
    print(f"elapsed_s={time.perf_counter() - t0:.1f}")
    print(f"ratio={min(r.ratio for r in rows):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
