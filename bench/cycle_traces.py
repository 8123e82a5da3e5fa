"""Decode traces with Kimi K3's published routing statistics, and the router's forecast in them.

What K3's routing offers (issue 37, from published measurements on K3 itself): 29.5% of a
token's experts were also the previous token's (same layer); a static hot set of 16 experts
per layer (top-16 routing, 896 experts) recalls 20.5% of the routing; layer L+1's router applied
to layer L's output predicts L+1's experts with 92% precision at rank 1 and 59% recall over its
top 16. A trace here is decode only (one token a call), every MoE layer in order, token after
token: ``routed[t, l]`` is token t's experts in layer l (router order), ``forecast[t, l]`` the
guess for layer l+1 made at layer l (the last layer's row is -1: nothing guesses the next
token's first layer).

The generator, per layer: a popularity of a hot set (``hot`` experts, mass ``w``) over a flat
rest; each token keeps each of the previous token's experts with probability ``c`` and draws
the others from the popularity, without replacement. ``c`` and ``w`` are fitted (a few short
rounds) so the trace's measured reuse and hot-set recall are the targets. The forecast's rank 1
is a routed expert with probability 0.92; ranks 2..k are each routed with the probability that
makes the top-k recall 0.59; a wrong guess is drawn from the popularity among the unrouted.

Invariant: same spec (seed included) => the same trace; only the spec's own Generator is used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CycleSpec:
    name: str = "k3-scaled"
    layers: int = 6
    experts: int = 256
    top_k: int = 4
    tokens: int = 400
    hot: int = 0  # the static hot set's size (0: top_k)
    reuse: float = 0.295  # share of a token's experts that were the previous token's
    hot_recall: float = 0.205  # share of the routing the static hot set holds
    rank1: float = 0.92  # forecast precision at rank 1
    recall: float = 0.59  # forecast recall over its top_k
    seed: int = 0


# K3 itself (92 MoE layers x 896 experts, top-16), and the held-out model's scale of issue 37.
K3 = CycleSpec("k3", layers=92, experts=896, top_k=16, tokens=160, hot=16)
SCALED = CycleSpec()


@dataclass(frozen=True)
class CycleTrace:
    spec: CycleSpec
    routed: np.ndarray  # [tokens, layers, top_k] expert ids
    forecast: np.ndarray  # [tokens, layers, top_k]: the guess for layer l+1; -1 in the last
    popularity: np.ndarray  # [layers, experts]: the law fresh draws follow
    keep: float  # each of the previous token's experts is kept with this chance

    def calls(self) -> list[tuple[int, list[int], list[int] | None]]:
        """(layer, experts, the guess for the next layer or None), in decode order."""
        out = []
        for t in range(self.routed.shape[0]):
            for layer in range(self.routed.shape[1]):
                guess = self.forecast[t, layer]
                out.append((layer, self.routed[t, layer].tolist(),
                            guess.tolist() if guess[0] >= 0 else None))
        return out

    def stats(self) -> dict[str, float]:
        return measure(self.routed, self.forecast, self.spec.hot or self.spec.top_k)


def generate(spec: CycleSpec) -> CycleTrace:
    """The trace, with ``c`` and ``w`` fitted to the spec's reuse and hot-set recall."""
    c, w = spec.reuse, spec.hot_recall
    probe = dataclasses.replace(spec, tokens=min(spec.tokens, 200))
    for _ in range(6):  # fixed-point rounds on a short trace: each nudges c and w to the targets
        got = measure(_routing(probe, c, w)[0], None, spec.hot or spec.top_k)
        c = float(np.clip(c + spec.reuse - got["reuse"], 0.0, 0.95))
        w = float(np.clip(w + spec.hot_recall - got["hot_recall"], 0.0, 0.95))
    routed, popularity = _routing(spec, c, w)
    return CycleTrace(spec, routed, _forecast(spec, routed, popularity), popularity, c)


def _routing(spec: CycleSpec, c: float, w: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    n, k, hot = spec.experts, spec.top_k, spec.hot or spec.top_k
    popularity = np.full((spec.layers, n), (1.0 - w) / (n - hot))
    for layer in range(spec.layers):
        popularity[layer, rng.choice(n, hot, replace=False)] = w / hot
    with np.errstate(divide="ignore"):  # w = 1: the cold experts are never drawn (log 0)
        logp = np.log(popularity)
    routed = np.empty((spec.tokens, spec.layers, k), dtype=np.int64)
    prev: np.ndarray | None = None
    for t in range(spec.tokens):
        keys = logp + rng.gumbel(size=logp.shape)  # Gumbel top-k: draws without replacement
        if prev is not None:
            kept = rng.random(prev.shape) < c
            rows = np.broadcast_to(np.arange(spec.layers)[:, None], prev.shape)
            keys[rows[kept], prev[kept]] = np.inf  # kept experts sort first
        order = np.argsort(-keys, axis=1)[:, :k]
        routed[t] = order
        prev = order
    return routed, popularity


def _forecast(spec: CycleSpec, routed: np.ndarray, popularity: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(spec.seed + 1_000_003)
    tokens, layers, k = routed.shape
    rest = later_ranks(spec)
    out = np.full(routed.shape, -1, dtype=np.int64)
    for t in range(tokens):
        for layer in range(layers - 1):
            truth = routed[t, layer + 1]
            right = rng.random(k) < np.r_[spec.rank1, np.full(k - 1, rest)]
            picks = rng.permutation(truth)[: int(right.sum())]
            p = popularity[layer + 1].copy()
            p[truth] = 0.0
            wrong = rng.choice(spec.experts, k - picks.size, replace=False, p=p / p.sum())
            guess = np.empty(k, dtype=np.int64)
            guess[right] = picks
            guess[~right] = wrong
            out[t, layer] = guess
    return out


def later_ranks(spec: CycleSpec) -> float:
    """The chance each forecast rank 2..k is routed: the recall over top_k less rank 1's."""
    return (spec.recall * spec.top_k - spec.rank1) / max(spec.top_k - 1, 1)


def measure(routed: np.ndarray, forecast: np.ndarray | None, hot: int) -> dict[str, float]:
    """The statistics the spec names, measured on a trace."""
    tokens, layers, k = routed.shape
    same = [np.intersect1d(routed[t, m], routed[t - 1, m]).size
            for t in range(1, tokens) for m in range(layers)]
    recall = 0
    for m in range(layers):
        counts = np.bincount(routed[:, m].ravel())
        top = np.argsort(-counts, kind="stable")[:hot]
        recall += int(np.isin(routed[:, m], top).sum())
    out = {"reuse": float(np.mean(same)) / k, "hot_recall": recall / routed.size}
    if forecast is not None:
        guess, truth = forecast[:, :-1], routed[:, 1:]
        hit = (guess[..., :, None] == truth[..., None, :]).any(-1)
        out["rank1"] = float(hit[..., 0].mean())
        out["recall"] = float(hit.mean())
    return out


if __name__ == "__main__":
    for spec in (SCALED, K3):
        print(spec.name, {k: round(v, 3) for k, v in generate(spec).stats().items()})
