"""The time to the first token of a prompt of N tokens, prefilled layer by layer (docs/engine.md,
"Prefill, layer by layer"): cold from the Hub, warm from disk, and from the pool.

    first token = compute + calls x call + layers x (miss call) + the reads' bytes at their rate

Reads per MoE layer. mlx-lm's loop prefills ``N - 1`` tokens in steps of ``step`` and the last
token alone; the engine runs them layer-major. With flat routing a step of ``r`` tokens routes
to ``E (1 - (1 - k/E)^r)`` distinct experts of ``E`` (``distinct``), the prompt to that with
``r = N`` (``E(L)``); a trace gives them as recorded.
- The pool holds a layer's routed experts (``P >= E(L)``): each is read once, ``E(L)`` reads.
- It holds less: within the layer the steps run in order, each keeping what the pool kept from
  the step before: ``S x e - (S - 1) x P`` reads (``S`` steps of ``e`` experts), at least
  ``E(L)``.
- The last layer's experts are read for the last token only (the steps before it feed nothing
  there: ``prefill``'s invariant).
- mlx-lm's loop runs the next token's forward before it yields the first (``generate_step``
  queues it first), so its ``k`` experts a layer are read before the first token too, unless
  the pool holds every expert the prompt routed to.
A step routing to more experts than the pool holds runs in groups of half the pool
(``calls.run_groups``), each a call of its own that reads; else a step is one call, and reads
where it routes to experts the pool does not hold yet (the first step of a layer whose routed
experts it holds: about one a layer).

Cold: every distinct routed expert fetched from the Hub first (a resolve per shard,
``MAX_PARALLEL_FETCHES`` at a time), the re-reads from the page cache. Warm: every read off the
disk cache, at the page cache's rate for the share of it that fits beside the pool in memory and
the SSD's for the rest. From the pool: the reads less what the pool holds already (a pool
holding all of them: the compute alone).

The compute is the probe's (``probe.moe_layer_s``: the routed experts' compute for one step's
rows, mlx-lm's ``SwitchGLU``) scaled by the prompt's tokens, or given (``--prefill-ms``);
attention and dense layers are left out, as in the decode projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cachecd import constants
from cachecd.manifest.manifest import Manifest


def distinct(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts of ``experts`` that ``tokens`` tokens route to, each to
    ``top_k`` distinct ones uniformly (flat routing)."""
    if tokens <= 0:
        return 0.0
    return experts * (1 - (1 - top_k / experts) ** tokens)


def steps_of(tokens: int, step: int) -> list[int]:
    """The rows of each step mlx-lm's ``generate_step`` prefills: ``tokens - 1`` in steps of
    ``step``, then the last token (its own call, whose logits are used)."""
    rest = max(0, tokens - 1)
    return [min(step, rest - i) for i in range(0, rest, step)] + [1]


@dataclass
class PromptReads:
    per_layer: list[float]  # expected reads of each MoE layer
    routed: list[float]  # distinct experts each MoE layer routes to over the prompt
    slots: int  # the pool's
    steps: int
    calls: float = 0.0  # MoE layer calls (a step's groups each one)
    miss_calls: float = 0.0  # of which read experts
    next_reads: float = 0.0  # the next token's, read before the first is yielded

    @property
    def reads(self) -> float:
        return sum(self.per_layer) + self.next_reads

    @property
    def unique(self) -> float:
        return sum(self.routed)

    @property
    def fits(self) -> bool:
        """The pool holds each layer's routed experts: each is read once."""
        return all(self.slots >= r for r in self.routed)


def prompt_reads(manifest: Manifest, top_k: int, tokens: int, step: int,
                 slots: int) -> PromptReads:
    e = manifest.experts_per_layer
    rows = steps_of(tokens, step)
    layers = manifest.moe_layers
    last = max(layers)
    per: list[float] = []
    routed: list[float] = []
    out = PromptReads(per, routed, slots, len(rows))
    for layer in layers:
        used = rows[-1:] if layer == last else rows  # the last layer: the last token's only
        whole = distinct(e, top_k, sum(used))
        each = [distinct(e, top_k, r) for r in used]
        if slots >= whole:
            reads = whole
            out.miss_calls += 1
        else:  # each step keeps what the step before left in the pool
            reads = max(whole, sum(each) - (len(each) - 1) * slots)
            out.miss_calls += sum(groups(x, slots) for x in each)
        out.calls += sum(groups(x, slots) for x in each)
        per.append(reads)
        routed.append(whole)
    out.calls += len(layers)  # the next token's forward
    if slots < out.unique:
        out.next_reads = float(top_k * len(layers))
        out.miss_calls += len(layers)
    return out


def groups(experts: float, slots: int) -> int:
    """The calls a step routing to ``experts`` makes with a pool of ``slots``."""
    return 1 if experts <= slots else math.ceil(experts / max(1, slots // 2))


def expert_bytes(manifest: Manifest) -> float:
    """One expert's bytes, on average over the routed experts."""
    return manifest.expert_bytes_total / (len(manifest.moe_layers) * manifest.experts_per_layer)


def prefill_compute_s(manifest: Manifest, top_k: int, tokens: int, step: int,
                      dtype: str = "float32") -> float:
    """The routed experts' compute of the prompt: the probe's layer call for one step's rows,
    times the steps' share of the prompt, times the MoE layers."""
    from cachecd.plan.probe import moe_layer_s

    rows = max(1, min(step, tokens))
    return moe_layer_s(manifest, top_k, dtype, rows=rows) * tokens / rows \
        * len(manifest.moe_layers)


def project(manifest: Manifest, machine: Any, reads: PromptReads, compute_s: float,
            costs: Any, pool_bytes: int, tokens: int) -> dict[str, Any]:
    """The prompt's first token cold, warm and from the pool (seconds; None where a rate is
    not measured), and what it reads. From the pool, no call reads."""
    from cachecd.plan.speed import page_share, queue_depth, read_s

    b = expert_bytes(manifest)
    layers = len(manifest.moe_layers)
    base = compute_s + reads.calls * costs.call_s + reads.miss_calls * costs.miss_call_s
    share = page_share(machine, pool_bytes, manifest.expert_bytes_total)

    def from_disk(nbytes: float) -> float | None:
        rate = costs.cold_rate or machine.cold_at(queue_depth(nbytes / layers))
        cold, cached = read_s(nbytes * (1 - share), rate), read_s(nbytes * share, machine.page_rate)
        return None if cold is None or cached is None else cold + cached

    warm = from_disk(reads.reads * b)
    held = min(reads.slots, reads.unique)
    left = max(0.0, reads.reads - held)
    pool = from_disk(left * b)
    if pool is not None:  # the calls that read: as many fewer as the reads
        pool -= reads.miss_calls * costs.miss_call_s * (1 - left / reads.reads)
    hub = None
    if machine.hub_rate and machine.resolve_s is not None:
        resolves = math.ceil(len(manifest.shards) / constants.MAX_PARALLEL_FETCHES)
        again = read_s((reads.reads - reads.unique) * b, machine.page_rate) or 0.0
        hub = base + resolves * machine.resolve_s + reads.unique * b / machine.hub_rate + again
    return {
        "tokens": tokens, "steps": reads.steps, "slots": reads.slots, "calls": reads.calls,
        "miss_calls": reads.miss_calls,
        "pool_holds_a_layer": reads.fits,
        "routed_experts": round(reads.unique, 1), "reads": round(reads.reads, 1),
        "read_bytes": int(reads.reads * b), "routed_bytes": int(reads.unique * b),
        "compute_s": compute_s,
        "first_token_s": {"cold": hub, "warm": None if warm is None else base + warm,
                          "pool": None if pool is None else base + pool},
        "note": None if reads.fits else pool_note(reads),
    }


def pool_note(reads: PromptReads) -> str:
    worst = max(reads.routed)
    return (f"the pool holds {reads.slots} experts, less than the {worst:.0f} a layer routes to "
            f"over this prompt: within a layer each step reads again what the pool could not "
            f"keep from the step before (S x e - (S - 1) x P reads a layer; docs/engine.md), "
            f"{reads.reads / reads.unique:.2f}x one pass over the routed experts; a pool of "
            f"{worst:.0f} slots reads each once")
