"""Routing traces for the cache-policy evaluation: recorded from the engine, read from files, or
synthetic, each cut into a warm-up part (train) and a scored part (test).

A request stream is a 1-D int64 array of keys ``layer * KEY_STRIDE + expert``, one per
(token, routed expert) in the engine's order: layer calls in order, and within a layer call the
token rows in order, each row's experts in the router's order (the order of the
``cachecd-trace`` lines, see ``cachecd_engine.trace``). Decoding one token is one layer call
per MoE layer; a prefill is one call per layer over all its tokens.

Invariants:
- Train and test of an engine split come from DIFFERENT prompts (held-out scoring); a synthetic
  split cuts one stream in time, and its popularity keeps drifting across the cut.
- Same arguments and seed => the same requests (synthetic generators use only their own
  ``numpy.random.Generator``; the tiny model is byte-identical for a seed and greedy decoding
  is deterministic).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KEY_STRIDE = 1 << 20  # more experts per layer than any model has

# Varied texts (prose, code, data, other languages and scripts): the tiny model's weights are
# random, but its routing depends on the tokens (bytes), so different kinds of text route
# differently. Even indices warm the cache, odd ones are scored.
PROMPTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Bonjour, je voudrais réserver une table pour quatre personnes ce soir à vingt heures.",
    "SELECT name, COUNT(*) FROM orders JOIN users ON users.id = orders.user_id GROUP BY name;",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    '{"id": 17, "tags": ["alpha", "beta"], "price": 12.5, "in_stock": true}',
    "Explain why the sky is blue in terms a ten-year-old would understand.",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; } return sum;",
    "Der Zug nach Berlin hat heute leider zwanzig Minuten Verspätung.",
    "Integrate x^2 * exp(-x) from 0 to infinity and show each step of the calculation.",
    "1. Preheat the oven to 200C.\n2. Mix flour, sugar and butter.\n3. Bake for 25 minutes.",
    "我们明天早上九点在火车站见面，然后一起去博物馆。",
    "git rebase -i HEAD~3 && git push --force-with-lease origin feature/cache-policy",
    "Summarize the causes of the French Revolution in three bullet points.",
    "El mercado abre a las ocho y cierra a las dos de la tarde los sábados.",
    '<html><body><h1>Hello</h1><p class="note">Cache miss rate: 4.2%</p></body></html>',
    "Roses are red, violets are blue, the cache was cold, and the latency too.",
    "import numpy as np\nx = np.linspace(0, 1, 100)\ny = np.sin(2 * np.pi * x)\n",
    "What is the difference between a process and a thread? Give an example of each.",
    "Москва — столица России, крупнейший по численности населения город страны.",
    "The meeting is moved to Thursday at 3pm; please bring the quarterly numbers.",
    'fn main() { let v: Vec<u32> = (1..=10).map(|x| x * x).collect(); println!("{:?}", v); }',
    "Translate into English: 'La vie est belle quand on prend le temps de la regarder.'",
    "ERROR 2024-05-01T12:00:03Z disk full on /var/cache (wanted 17547264 bytes, free 0)",
    "Once upon a time, in a kingdom by the sea, there lived a princess who loved maps.",
    "SELECT * FROM experts WHERE layer = 42 AND hits > 1000 ORDER BY hits DESC LIMIT 16;",
    "Dear hiring manager, I am writing to apply for the position of data engineer.",
    "const add = (a, b) => a + b;\nconsole.log([1, 2, 3].reduce(add, 0));",
    "東京タワーは一九五八年に完成した電波塔で、高さは三百三十三メートルです。",
    "Prove that the square root of two is irrational, using contradiction.",
    "Temperature: 21.4C, humidity 48%, wind 12 km/h NW, pressure 1013 hPa.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n",
    "List five tips for a first marathon, with one sentence of explanation each.",
    "Il était une fois un petit chat qui vivait sous les toits de Paris.",
    "curl -sS -H 'Range: bytes=0-1023' https://example.com/model-00001-of-00096.safetensors",
    "The mitochondria is the powerhouse of the cell, producing ATP through respiration.",
    "Q: How many moons does Mars have? A: Two, Phobos and Deimos.",
    '#include <stdio.h>\nint main(void) { printf("hello, world\\n"); return 0; }',
    "Ein Mann geht in eine Bäckerei und bestellt zwei Brötchen und einen Kaffee.",
    "Design a REST API for a library: books, members, loans, and overdue notices.",
    "a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y, z",
    "The stock closed at 182.37, up 2.4% on the day, after strong earnings guidance.",
    "아침에 일어나서 커피를 마시고 공원에서 산책을 했습니다.",
    "Describe the water cycle: evaporation, condensation, precipitation, collection.",
    "kubectl get pods -n cachecd -o wide | grep -v Running | awk '{print $1}'",
    "She sells seashells by the seashore, and the shells she sells are surely seashells.",
    "0x7f3a 0x0000 0xdead 0xbeef 0x1234 0xffff 0x00ff 0xabcd 0x5555 0xaaaa",
    "Plan a three-day trip to Kyoto with temples, food markets and a day hike.",
)


@dataclass(frozen=True)
class Stream:
    """Requests in order, and where each layer call starts in them."""

    keys: np.ndarray  # int64 keys, layer * KEY_STRIDE + expert
    starts: np.ndarray  # int64 offsets of the calls, ascending, starts[0] == 0 when non-empty
    # Synthetic traces only: per request, the row of ``Split.dists`` it was drawn from.
    states: np.ndarray | None = None

    @classmethod
    def of_calls(cls, calls: list[np.ndarray]) -> Stream:
        keys = np.concatenate(calls).astype(np.int64) if calls else np.zeros(0, np.int64)
        return cls.of_sizes(keys, np.array([c.size for c in calls], dtype=np.int64))

    @classmethod
    def of_sizes(cls, keys: np.ndarray, sizes: np.ndarray) -> Stream:
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if sizes.size else sizes
        return cls(keys.astype(np.int64), starts.astype(np.int64))

    def per_call(self) -> Stream:
        """The daemon's view: each expert once per layer call (the engine fetches a call's
        distinct experts together), in first-use order."""
        if self.keys.size == 0:
            return self
        call = self.call_of()
        first = self._firsts(call)
        kept = np.bincount(call[first], minlength=self.starts.size)
        starts = np.concatenate([[0], np.cumsum(kept)[:-1]]).astype(np.int64)
        return Stream(self.keys[first], starts, _take(self.states, first))

    def call_of(self) -> np.ndarray:
        """For each request, the index of its call."""
        return np.repeat(
            np.arange(self.starts.size), np.diff(np.append(self.starts, self.keys.size))
        )

    def first_in_call(self) -> np.ndarray:
        """A mask of the requests that are their expert's first in their call (what the daemon
        sees); the others repeat an expert the same call already asked for."""
        mask = np.zeros(self.keys.size, dtype=bool)
        if self.keys.size:
            mask[self._firsts(self.call_of())] = True
        return mask

    def _firsts(self, call: np.ndarray) -> np.ndarray:
        """Ascending positions of the requests that are their expert's first in their call."""
        _, first = np.unique(call * (KEY_STRIDE << 12) + self.keys, return_index=True)
        return np.sort(first)

    def shuffled(self, rng: np.random.Generator) -> Stream:
        """The same calls in a random order: each layer's calls are shuffled among the places
        that layer's calls held, so the layers still take turns as before and every expert is
        requested as often, but when is left to chance. What a policy can learn from such a
        trace is how often, not when."""
        ends = np.append(self.starts[1:], self.keys.size)
        layer_of = self.keys[self.starts] // KEY_STRIDE
        order = np.arange(self.starts.size)
        for layer in np.unique(layer_of):
            slots = np.flatnonzero(layer_of == layer)
            order[slots] = rng.permutation(slots)
        calls = [self.keys[self.starts[j] : ends[j]] for j in order.tolist()]
        return Stream.of_calls(calls)

    def cut(self, frac: float) -> tuple[Stream, Stream]:
        """(head, tail) at the first call boundary at or after ``frac`` of the requests."""
        i = int(np.searchsorted(self.starts, int(self.keys.size * frac)))
        at = int(self.starts[i]) if i < self.starts.size else self.keys.size
        return (
            Stream(self.keys[:at], self.starts[:i], _take(self.states, slice(None, at))),
            Stream(self.keys[at:], self.starts[i:] - at, _take(self.states, slice(at, None))),
        )


def _take(states: np.ndarray | None, where: np.ndarray | slice) -> np.ndarray | None:
    return None if states is None else states[where]


@dataclass(frozen=True)
class Split:
    """A named trace: warm-up requests, scored requests and the size of the expert set."""

    name: str
    train: Stream
    test: Stream
    n_experts: int  # MoE layers x experts per layer: what a cache percentage is of
    # Synthetic traces only: [state, layer, expert] -> the probability that a token's routing
    # in that layer picks that expert first, in the state (sequence) a request was drawn in.
    dists: np.ndarray | None = None

    def per_call(self) -> Split:
        return Split(
            f"{self.name}/call",
            self.train.per_call(),
            self.test.per_call(),
            self.n_experts,
            self.dists,
        )

    def describe(self) -> str:
        return (
            f"{self.name}: {self.n_experts} experts, train {self.train.keys.size} requests, "
            f"test {self.test.keys.size} requests"
        )


# ---- recorded traces ------------------------------------------------------------------


def read_requests(path: str | Path) -> Stream:
    """The requests of a ``cachecd-trace`` file, in the order they were recorded."""
    calls: list[np.ndarray] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            if "format" in record:
                continue  # a run's header; cachecd_engine.trace.read_trace validates files
            rows = np.asarray(record["experts"], dtype=np.int64).reshape(-1)
            calls.append(int(record["layer"]) * KEY_STRIDE + rows)
    return Stream.of_calls(calls)


def expert_set_size(keys: np.ndarray) -> int:
    """Layers seen x (highest expert id seen + 1): the expert set, when no manifest says it."""
    if keys.size == 0:
        return 0
    layers = np.unique(keys // KEY_STRIDE).size
    return int(layers * (int((keys % KEY_STRIDE).max()) + 1))


def split_by_time(
    name: str, stream: Stream, train_frac: float, n_experts: int, dists: np.ndarray | None = None
) -> Split:
    train, test = stream.cut(train_frac)
    return Split(name, train, test, n_experts, dists)


# ---- the tiny engine ------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    """A tiny K3-architecture model to route prompts through."""

    experts: int = 32
    layers: int = 6  # layer 0 is dense: layers - 1 MoE layers
    top_k: int = 4
    max_new: int = 32  # greedy tokens decoded after each prompt

    @property
    def name(self) -> str:
        return f"engine-{self.layers - 1}x{self.experts}k{self.top_k}"


def record_engine(spec: EngineSpec, work: Path, train: list[str], test: list[str]) -> Split:
    """Write the tiny model, route both prompt sets through the streamed engine (experts read
    from the local checkpoint), record each set with ``TraceRecorder`` and read them back."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # as the cachecd CLI does
    from mlx_lm import stream_generate

    from cachecd.testbed.tiny_model import write_tiny_model
    from cachecd_engine.loader import load
    from cachecd_engine.local_source import LocalSource, manifest_from_dir
    from cachecd_engine.trace import TraceRecorder

    ckpt = work / spec.name
    write_tiny_model(ckpt, experts=spec.experts, layers=spec.layers, top_k=spec.top_k)
    model, tokenizer = load(ckpt, LocalSource(manifest_from_dir(ckpt), ckpt))
    out = []
    for part, prompts in (("train", train), ("test", test)):
        path = work / f"{spec.name}.{part}.jsonl"
        recorder = TraceRecorder(path, model=spec.name)
        model.bank.trace = recorder
        try:
            for prompt in prompts:
                for _ in stream_generate(model, tokenizer, prompt, max_tokens=spec.max_new):
                    pass
        finally:
            recorder.close()
        out.append(read_requests(path))
    return Split(spec.name, out[0], out[1], (spec.layers - 1) * spec.experts)


def routing_skew(requests: np.ndarray, n_experts_per_layer: int) -> tuple[float, float]:
    """(share of requests going to each layer's top 10% experts, the uniform share), averaged
    over layers: how far the routing is from uniform."""
    shares = []
    top = max(1, n_experts_per_layer // 10)
    for layer in np.unique(requests // KEY_STRIDE):
        ids = requests[requests // KEY_STRIDE == layer] % KEY_STRIDE
        counts = np.sort(np.bincount(ids, minlength=n_experts_per_layer))[::-1]
        shares.append(counts[:top].sum() / counts.sum())
    return float(np.mean(shares)), top / n_experts_per_layer


# ---- synthetic K3-like routing -------------------------------------------------------


@dataclass(frozen=True)
class SynthSpec:
    """Scaled-down K3 routing: per-layer Zipf popularity that drifts, bursty sequences."""

    name: str = "synth"
    layers: int = 16
    experts: int = 256
    top_k: int = 8
    tokens: int = 16_000
    train_frac: float = 0.4
    zipf: tuple[float, float] = (0.8, 1.2)  # per-layer exponent range
    drift_every: int = 1_000  # tokens between topic changes
    drift_frac: float = 0.15  # fraction of each layer's ranking reshuffled at a change
    seq_len: tuple[int, int] = (64, 512)  # tokens per sequence (prompt + decode)
    prefill_frac: float = 0.5  # first part of a sequence is one prefill call per layer
    burst_experts: int = 24  # experts per layer a sequence favours
    burst_boost: float = 4.0  # their popularity multiplier within that sequence
    seed: int = 0


def synthetic(spec: SynthSpec) -> Split:
    rng = np.random.default_rng(spec.seed)
    exps = rng.uniform(*spec.zipf, size=spec.layers)
    base = 1.0 / np.arange(1, spec.experts + 1)[None, :] ** exps[:, None]  # [layer, rank]
    ranking = np.stack([rng.permutation(spec.experts) for _ in range(spec.layers)])
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    dists: list[np.ndarray] = []  # each sequence's routing distribution, [layer, expert]
    done, next_drift = 0, spec.drift_every
    while done < spec.tokens:
        n = min(int(rng.integers(*spec.seq_len, endpoint=True)), spec.tokens - done)
        while done + n > next_drift and next_drift < spec.tokens:
            _drift(rng, ranking, spec.drift_frac)
            next_drift += spec.drift_every
        keys, sizes, weights = _sequence(rng, spec, base, ranking, n)
        parts.append((keys, sizes))
        dists.append(weights / weights.sum(axis=1, keepdims=True))
        done += n
    stream = dataclasses.replace(
        Stream.of_sizes(
            np.concatenate([k for k, _ in parts]), np.concatenate([n for _, n in parts])
        ),
        states=np.concatenate([np.full(k.size, i, np.int32) for i, (k, _) in enumerate(parts)]),
    )
    return split_by_time(
        spec.name, stream, spec.train_frac, spec.layers * spec.experts, np.stack(dists)
    )


def _drift(rng: np.random.Generator, ranking: np.ndarray, frac: float) -> None:
    """A topic change: in each layer a random subset of ranks swaps their experts around."""
    n = ranking.shape[1]
    moved = max(2, int(n * frac))
    for row in ranking:
        slots = rng.choice(n, size=moved, replace=False)
        row[slots] = row[rng.permutation(slots)]


def _sequence(
    rng: np.random.Generator, spec: SynthSpec, base: np.ndarray, ranking: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sequence's requests, routed [token, layer, k] then laid out in the engine's order,
    the sizes of its layer calls, and the routing weights they were drawn with [layer, expert]."""
    weights = np.empty_like(base)
    for layer in range(spec.layers):
        weights[layer, ranking[layer]] = base[layer]  # expert ranking[l][r] has weight base[l][r]
        favoured = rng.choice(spec.experts, size=spec.burst_experts, replace=False)
        weights[layer, favoured] *= spec.burst_boost
    # Top-k of log-weight plus Gumbel noise = k draws without replacement, all tokens at once.
    noise = rng.gumbel(size=(n, spec.layers, spec.experts))
    keys = np.log(weights)[None, :, :] + noise
    routed = np.argpartition(-keys, spec.top_k - 1, axis=2)[:, :, : spec.top_k]
    routed = routed + (np.arange(spec.layers) * KEY_STRIDE)[None, :, None]
    prefill = max(1, int(n * spec.prefill_frac))
    head = routed[:prefill].transpose(1, 0, 2).reshape(-1)  # one call per layer, tokens inside
    tail = routed[prefill:].reshape(-1)  # decoding: token by token, layer by layer
    sizes = [prefill * spec.top_k] * spec.layers + [spec.top_k] * (spec.layers * (n - prefill))
    return np.concatenate([head, tail]), np.array(sizes, dtype=np.int64), weights
