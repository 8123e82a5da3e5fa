"""One rank of a pipelined run (under ``mlx.launch``), or one machine alone: greedy tokens and the
logits each was chosen from, through ``cachecd_engine.load``.

``python -m tests.pipeline_rank SOCKET OUT PROMPT N``; ``{rank}`` in SOCKET and OUT becomes the
rank. The logits are captured where mlx-lm's ``generate_step`` hands them to its logits
processors, just before the sampler picks the token.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


def greedy_with_logits(model: Any, tokenizer: Any, prompt: str, n: int) -> tuple[list[int],
                                                                                 np.ndarray]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    seen: list[np.ndarray] = []

    def capture(tokens: Any, logits: Any) -> Any:
        seen.append(np.array(logits.astype(mx.float32)))
        return logits

    ids = mx.array(tokenizer.encode(prompt))
    steps = generate_step(ids, model, max_tokens=n, logits_processors=[capture])
    tokens = [int(token) for token, _ in steps]
    return tokens, np.concatenate(seen)


def main(socket: str, out: str, prompt: str, n: str) -> None:
    import cachecd_engine
    from cachecd_engine.pipeline import launched_group, rank_path

    group = launched_group()
    rank = group.rank() if group is not None else 0
    model, tokenizer = cachecd_engine.load("cachecd/tiny-k3", socket=socket, ram_bytes=0)
    tokens, logits = greedy_with_logits(model, tokenizer, prompt, int(n))
    layers = sorted(glu.layer for _, glu in model.named_modules() if hasattr(glu, "_bank"))
    np.savez(str(rank_path(out, rank)), tokens=np.array(tokens), logits=logits,
             layers=np.array(layers))
    model.bank.close()
    model.bank.source.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
