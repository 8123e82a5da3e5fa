"""RAM-tier replacement policies against Belady's optimum, in the engine's view of routing traces.

The engine's RAM tier (``cachecd_engine.ram_tier.RamTier``) sits in front of the daemon and is
driven by one of the daemon's policies (``cachecd.store.policies``). This bench replays routing traces
through each policy exactly as the engine drives its tier, and prints hit rates beside Belady's
optimum for the same requests, so that the tier's default policy is chosen by measurement.

The view is the per-call one (``Stream.per_call``; the requests ``first_in_call`` marks), not the
per-token one: the bank takes ``np.unique(routed)`` of a layer call and asks the tier once for
each distinct expert, so a decode call asks for one token's top-k of one layer and a prefill call
for every distinct expert its tokens route to. On top of that view bench/tier_sim.py keeps the
bank's order (ascending ids; a call's lookups before its admissions; calls over one stack buffer
in groups of it, 122 experts for K3 with the default 4 GiB of expert memory) and bounds it with
Belady for that batched tier (``belady_batches``, which in-order MIN is not).

Budgets are counts of experts (all experts of a model have one size), in tokens' worth: one
decoded token's working set is MoE layers x top_k experts (K3: 92 x 16 = 1,472 experts, 24.1
GiB). Below one token's worth a tier cannot hold what the other layers' calls pass through
between a layer's call and the same layer's call for the next token: LRU keeps nothing there.
Plus 10 % and 25 % of all experts. At K3 the old default (2 GiB, ~122 experts) is 0.08 tokens'
worth, a quarter of 64 GiB is ~0.7.

Traces, each warmed on one part and scored on another (held-out):
  k3-*        synthetic (bench/traces.py) with K3's per-layer shape, 16 routed of 896, over
              fewer layers (a budget in tokens' worth is then the same share of each layer as
              on K3): drifting per-layer Zipf popularity, bursty sequences, a prefill call per
              layer then decoding; prefill calls in groups of 122. ``k3``: the hottest 30 % of
              each layer's experts carry ~83 % of routes (DESIGN.md: 85.6 % on K3 decode).
              ``k3-reuse``: the same trace plus token-to-token reuse (``with_reuse``: each
              expert of a layer's previous decode call is routed again with probability 0.5),
              an assumption standing in for the recency that published K3 replays reward (62 %
              hits against LFU's 12 %), which independent draws lack. ``k3-flat``: less skew.
  engine-*    the tiny K3-architecture model (random weights, byte tokens) run in-process
              through the streamed engine, routing recorded with TraceRecorder; 24 prompts warm,
              24 OTHER prompts are scored (policy_eval's engines: 5 x 32 and 7 x 64, top-4).
  --trace F   a recorded ``cachecd-trace`` file, cut in time (``--train-frac``).
``reuse`` in the trace lines is ``decode_reuse``: the share of a decode call's experts that the
same layer's previous token routed to as well.

Policies: ``lru``, ``lfuda``, ``wlfu`` from cachecd.store.policies; ``lru/layer``, a prototype that
lives only here (LRU with per-layer quotas, ``LayerQuotaLRU``). ``fixed*`` is the best fixed set
of that many experts in hindsight (the most asked-for of the scored part): what static pins
could do at best. The recommended default is the cachecd policy with the highest worst-row
policy/Belady (ties: the higher mean).

Last line: ``ratio=X``, the recommended policy's hit rate / Belady on its worst row.

    python bench/ram_tier.py [--tokens 4000] [--layers 8] [--max-new 32] [--jobs 2]
                             [--no-engine] [--no-prototypes] [--trace FILE ...] [--train-frac 0.5]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from policy_eval import ENGINES, fixed_best  # noqa: E402
from tier_sim import (  # noqa: E402
    belady_batches,
    decode_reuse,
    engine_view,
    replay_batches,
    with_reuse,
)
from traces import (  # noqa: E402
    KEY_STRIDE,
    PROMPTS,
    Split,
    SynthSpec,
    read_requests,
    record_engine,
    split_by_time,
    synthetic,
)

from cachecd.store.policies import EvictionPolicy, make_policy  # noqa: E402

K3_EXPERT_BYTES = 17_547_264
K3_TOKEN = 92 * 16  # experts one decoded K3 token routes to
K3_GROUP = (4 << 30) // 2 // K3_EXPERT_BYTES  # experts a stack buffer holds (engine/pool/memory.py)
TOKENS_WORTH = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
FRACTIONS = (0.10, 0.25)  # of all experts
CANDIDATES = ("lru", "lfuda", "wlfu")  # cachecd.store.policies names: what DEFAULT_POLICY can be
K3_SPEC = SynthSpec(name="k3", experts=896, top_k=16, zipf=(0.9, 1.3), burst_experts=84)
SYNTH: tuple[tuple[SynthSpec, float], ...] = (  # (spec, token-to-token reuse)
    (K3_SPEC, 0.0),
    (dataclasses.replace(K3_SPEC, name="k3-reuse"), 0.5),
    (
        SynthSpec(
            name="k3-flat",
            experts=896,
            top_k=16,
            zipf=(0.5, 0.8),
            drift_every=400,
            drift_frac=0.3,
            seq_len=(32, 256),
            prefill_frac=0.3,
            burst_experts=56,
            burst_boost=3.0,
            seed=1,
        ),
        0.0,
    ),
)


class LayerQuotaLRU:
    """Prototype (not in cachecd): LRU inside each layer, every layer held to an equal share.

    Keys are ``layer * KEY_STRIDE + expert``. The victim is the least recently used entry of
    the layer holding the most entries (ties: the layer used longest ago), so each layer keeps
    about ``capacity / layers`` of its own most recent experts through the cycle over layers
    that empties a plain LRU smaller than one token's worth.
    """

    name = "lru/layer"

    def __init__(self) -> None:
        self._layers: dict[int, OrderedDict[int, int]] = {}  # layer -> key -> size, oldest first
        self._used: dict[int, int] = {}  # layer -> tick of its last use
        self._tick = 0

    def __len__(self) -> int:
        return sum(len(d) for d in self._layers.values())

    def on_insert(self, digest: int, size: int, count: int = 0) -> None:
        self._layers.setdefault(digest // KEY_STRIDE, OrderedDict())[digest] = size
        self.on_access(digest)

    def on_access(self, digest: int) -> None:
        layer = self._layers.get(digest // KEY_STRIDE)
        if layer is not None and digest in layer:
            layer.move_to_end(digest)
            self._tick += 1
            self._used[digest // KEY_STRIDE] = self._tick

    def on_remove(self, digest: int) -> None:
        layer = self._layers.get(digest // KEY_STRIDE)
        if layer is not None:
            layer.pop(digest, None)

    def victims(self, n_bytes: int, exclude: Container[int]) -> list[int]:
        sizes = {lay: len(d) for lay, d in self._layers.items()}
        taken: dict[int, int] = {}
        out: list[int] = []
        got = 0
        while got < n_bytes and any(sizes.values()):
            lay = max(sizes, key=lambda x: (sizes[x], -self._used.get(x, 0)))
            sizes[lay] -= 1
            skip = taken.get(lay, 0)
            taken[lay] = skip + 1
            key = next(k for i, k in enumerate(self._layers[lay]) if i == skip)
            if key in exclude:
                continue
            out.append(key)
            got += self._layers[lay][key]
        return out


PROTOTYPES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru/layer": LayerQuotaLRU,  # type: ignore[dict-item]
}


@dataclass(frozen=True)
class Trace:
    """A split in the engine's view, and one decoded token's working set in experts."""

    split: Split
    per_token: int


@dataclass(frozen=True)
class Row:
    trace: str
    capacity: int  # experts the tier holds
    tokens: float  # capacity in decoded tokens' worth
    share: float  # capacity as a share of all experts
    rates: dict[str, float]  # policy, "fixed*" and "Belady" -> hit rate on the scored part

    def ratio(self, policy: str) -> float:
        best = self.rates["Belady"]
        return self.rates[policy] / best if best else 1.0


# Filled before the pool forks: workers read them, never pickle them.
_TRACES: dict[str, Trace] = {}
_MAKERS: dict[str, Callable[[], EvictionPolicy]] = {}


def _job(args: tuple[str, int, str]) -> tuple[tuple[str, int, str], float]:
    name, capacity, policy = args
    split = _TRACES[name].split
    if policy == "Belady":
        score = belady_batches(split.test, capacity)
    else:
        score = replay_batches(_MAKERS[policy], split.train, split.test, capacity)
    return (name, capacity, policy), score.rate


def capacities(trace: Trace) -> list[int]:
    """Distinct budgets in experts: tokens' worth, then fractions of all experts."""
    caps = [round(t * trace.per_token) for t in TOKENS_WORTH]
    caps += [round(f * trace.split.n_experts) for f in FRACTIONS]
    return sorted({max(1, c) for c in caps})


def evaluate(traces: list[Trace], jobs: int, prototypes: bool = True) -> list[Row]:
    """Every policy and Belady on every trace and budget."""
    _TRACES.clear()
    _TRACES.update({t.split.name: t for t in traces})
    _MAKERS.clear()
    _MAKERS.update({p: (lambda p=p: make_policy(p)) for p in CANDIDATES})
    if prototypes:
        _MAKERS.update(PROTOTYPES)
    todo = [
        (t.split.name, c, p) for t in traces for c in capacities(t) for p in (*_MAKERS, "Belady")
    ]
    todo.sort(key=lambda j: -_TRACES[j[0]].split.test.keys.size)  # longest first
    if jobs > 1:
        with mp.get_context("fork").Pool(jobs) as pool:
            done = dict(pool.imap_unordered(_job, todo))
    else:
        done = dict(_job(j) for j in todo)
    rows = []
    for t in traces:
        name = t.split.name
        for c in capacities(t):
            rates = {p: done[(name, c, p)] for p in (*_MAKERS, "Belady")}
            rates["fixed*"] = fixed_best(t.split.test.keys, c)
            rows.append(Row(name, c, c / t.per_token, c / t.split.n_experts, rates))
    return rows


def recommend(rows: list[Row]) -> str:
    """The candidate with the best worst row (policy/Belady), then the best mean."""

    def key(p: str) -> tuple[float, float]:
        ratios = [r.ratio(p) for r in rows]
        return min(ratios), float(np.mean(ratios))

    return max(CANDIDATES, key=key)


def table(rows: list[Row]) -> list[list[str]]:
    """Header and cells: budget, each policy's hit rate, fixed*, Belady, each policy / Belady."""
    policies = [p for p in rows[0].rates if p not in ("Belady", "fixed*")]
    header = ["trace", "tokens", "experts", "%all", *policies, "fixed*", "Belady"]
    header += [f"{p}/B" for p in policies]
    out = [header]
    for r in rows:
        out.append(
            [
                r.trace,
                f"{r.tokens:.2f}",
                str(r.capacity),
                f"{100 * r.share:.1f}",
                *(f"{r.rates[p]:.3f}" for p in policies),
                f"{r.rates['fixed*']:.3f}",
                f"{r.rates['Belady']:.3f}",
                *(f"{r.ratio(p):.3f}" for p in policies),
            ]
        )
    return out


def print_table(cells: list[list[str]]) -> None:
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    for c in cells:
        print(
            "  ".join(
                x.rjust(w) if i else x.ljust(w)
                for i, (x, w) in enumerate(zip(c, widths, strict=True))
            )
        )


def summary(rows: list[Row]) -> list[str]:
    """Per policy: worst row and mean of policy/Belady, and rows below / at least one token."""
    lines = []
    for p in [p for p in rows[0].rates if p not in ("Belady", "fixed*")]:
        worst = min(rows, key=lambda r: r.ratio(p))
        small = [r.ratio(p) for r in rows if r.tokens < 1]
        large = [r.ratio(p) for r in rows if r.tokens >= 1]
        lines.append(
            f"{p}: worst {worst.ratio(p):.3f} ({worst.trace} @ {worst.tokens:.2f} tokens), "
            f"mean {np.mean([r.ratio(p) for r in rows]):.3f}, "
            f"mean below 1 token {np.mean(small) if small else float('nan'):.3f}, "
            f"from 1 token {np.mean(large) if large else float('nan'):.3f}"
        )
    return lines


def build_traces(args: argparse.Namespace, work: Path) -> list[Trace]:
    out = []
    for base, reuse in SYNTH:
        spec = dataclasses.replace(
            base, name=f"{base.name}-{args.layers}L", layers=args.layers, tokens=args.tokens
        )
        raw = synthetic(spec)
        if reuse:
            train = with_reuse(raw.train, spec.top_k, reuse, seed=1)
            test = with_reuse(raw.test, spec.top_k, reuse, seed=2)
            raw = dataclasses.replace(raw, train=train, test=test)
        out.append(_trace("generated", raw, spec.top_k, spec.experts, K3_GROUP))
    if not args.no_engine:
        prompts = list(PROMPTS[0::2])[: args.prompts], list(PROMPTS[1::2])[: args.prompts]
        for base in ENGINES:
            t0 = time.perf_counter()
            spec = dataclasses.replace(base, max_new=args.max_new)
            raw = record_engine(spec, work, *prompts)
            out.append(_trace("recorded", raw, spec.top_k, spec.experts, None, t0))
    for path in args.trace:
        stream = read_requests(path)
        sizes = np.diff(np.append(stream.starts, stream.keys.size))
        top_k = int(np.bincount(sizes).argmax())  # decode calls are the commonest
        per_layer = int((stream.keys % KEY_STRIDE).max()) + 1
        layers = np.unique(stream.keys // KEY_STRIDE).size
        raw = split_by_time(Path(path).stem, stream, args.train_frac, layers * per_layer)
        out.append(_trace("read", raw, top_k, per_layer, args.group))
    return out


def _trace(
    verb: str, raw: Split, top_k: int, per_layer: int, group: int | None, t0: float | None = None
) -> Trace:
    """The engine's view of ``raw``, and a line about both views and the routing."""
    view = Split(
        raw.name, engine_view(raw.train, group), engine_view(raw.test, group), raw.n_experts
    )
    layers = raw.n_experts // per_layer
    keys = raw.test.keys
    shares = []
    for layer in np.unique(keys // KEY_STRIDE).tolist():
        counts = np.bincount(keys[keys // KEY_STRIDE == layer] % KEY_STRIDE, minlength=per_layer)
        shares.append(np.sort(counts)[::-1][: int(0.3 * per_layer)].sum() / counts.sum())
    took = "" if t0 is None else f" in {time.perf_counter() - t0:.1f}s"
    print(
        f"{verb} {raw.name}{took}: {layers} x {per_layer} experts, top-{top_k}; routes "
        f"train/test {raw.train.keys.size}/{keys.size}, tier requests {view.train.keys.size}/"
        f"{view.test.keys.size} ({view.test.starts.size} scored batches); top 30% of each "
        f"layer's experts get {np.mean(shares):.1%} of routes; reuse "
        f"{decode_reuse(raw.test.per_call(), top_k):.3f} (uniform {top_k / per_layer:.3f})",
        flush=True,
    )
    return Trace(view, layers * top_k)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp", help="where the work dir (removed at the end) goes")
    ap.add_argument("--tokens", type=int, default=4000, help="tokens per synthetic trace")
    ap.add_argument("--layers", type=int, default=8, help="MoE layers of the synthetic traces")
    ap.add_argument("--max-new", type=int, default=32, help="tokens decoded after each prompt")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS) // 2, help="prompts per half")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes for the replays")
    ap.add_argument("--no-engine", action="store_true", help="skip the tiny-engine traces")
    ap.add_argument("--no-prototypes", action="store_true", help="only the cachecd policies")
    ap.add_argument("--trace", action="append", default=[], help="a recorded cachecd-trace file")
    ap.add_argument("--train-frac", type=float, default=0.5, help="warm-up share of a --trace")
    ap.add_argument(
        "--group", type=int, default=K3_GROUP, help="experts per stack buffer, for a --trace"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="ram-tier-", dir=args.dir))
    try:
        traces = build_traces(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"one decoded K3 token's worth = {K3_TOKEN} experts = "
        f"{K3_TOKEN * K3_EXPERT_BYTES / (1 << 30):.1f} GiB; prefill groups of {K3_GROUP} on k3-*"
    )
    rows = evaluate(traces, args.jobs, not args.no_prototypes)
    best = recommend(rows)
    print_table(table(rows))
    for line in summary(rows):
        print(line)
    beaten = [
        f"{r.trace} @ {r.tokens:.2f} by {p} ({r.rates[p]:.3f} vs {r.rates[best]:.3f})"
        for r in rows
        for p in r.rates
        if p not in (best, "Belady", "fixed*") and r.rates[p] > r.rates[best]
    ]
    print(f"rows where a policy beats {best}: {'; '.join(beaten) or 'none'}")
    worst = min(rows, key=lambda r: r.ratio(best))
    print(
        f"recommended default: {best} (highest worst-row policy/Belady among "
        f"{', '.join(CANDIDATES)}; worst {worst.trace} @ {worst.tokens:.2f} tokens)"
    )
    print(f"elapsed_s={time.perf_counter() - t0:.1f}")
    print(f"ratio={worst.ratio(best):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
