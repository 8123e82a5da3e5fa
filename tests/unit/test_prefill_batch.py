"""The batch prefill ``prefill_batch`` runs ahead is the one reviewed: mlx-lm's
``PromptProcessingBatch.prompt`` drops each step's output and touches the caches only through
``prepare`` (padded steps), ``c.state`` and ``finalize``; ``BatchGenerator._next`` takes each
row's next ``min(len(segment), prefill_step_size)`` tokens. A new mlx-lm that changes either
fails here (and running ahead turns itself off until it is reviewed). The steps it predicts are
the ones a real ``BatchGenerator`` then takes."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch

from cachecd_engine import prefill_batch

REVIEW = ("mlx_lm's BatchGenerator prefill changed: check that PromptProcessingBatch.prompt "
          "still drops each step's output and touches the caches only through prepare, "
          "c.state and finalize, and _next's scheduling, then update "
          "prefill_batch.REVIEWED_SHA256")


def _tree(fn: Any) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(fn)))


def test_the_batch_prefill_is_the_reviewed_one() -> None:
    assert prefill_batch.loop_reviewed(), REVIEW


def test_prompt_drops_the_steps_output() -> None:
    tree = _tree(PromptProcessingBatch.prompt)
    calls = [n for n in ast.walk(tree)
             if isinstance(n, ast.Call) and ast.unparse(n.func) == "self.model"]
    assert len(calls) == 1, REVIEW
    dropped = [n for n in ast.walk(tree) if isinstance(n, ast.Expr) and n.value is calls[0]]
    assert dropped, REVIEW  # a bare statement: nothing keeps the output


def test_prompt_touches_the_caches_only_to_prepare_evaluate_and_finalize() -> None:
    uses = sorted({ast.unparse(n) for n in ast.walk(_tree(PromptProcessingBatch.prompt))
                   if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                   and n.value.id == "c"})
    assert uses == ["c.finalize", "c.prepare", "c.state"], REVIEW


class Echo(nn.Module):
    """A model with no layers: what the generator asks of it, and the steps it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[list[int]]] = []
        self.predicted: list[list[list[list[int]]]] = []

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        import sys

        found = prefill_batch.batch_step(sys._getframe(1))
        if found is not None:
            self.steps.append(inputs.tolist())
            self.predicted.append(prefill_batch.next_steps(found[1], found[0].prefill_step_size))
        kv = mx.zeros((inputs.shape[0], 1, inputs.shape[1], 1))
        cache[0].update_and_fetch(kv, kv)
        return mx.zeros((inputs.shape[0], inputs.shape[1], 8))

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        return [KVCache()]


def test_the_predicted_steps_are_the_ones_the_generator_takes() -> None:
    """Two prompts of 40 tokens at steps of 16: after the first step the generator will take
    16 and then 7 tokens of each (the last token is held for decode); the predictions made
    at each unpadded step are exactly the steps that follow."""
    model = Echo()
    gen = BatchGenerator(model, max_tokens=1, prefill_step_size=16)
    gen.insert([list(range(40)), list(range(100, 140))])
    while not gen.next_generated():
        pass
    gen.close()
    assert [len(s[0]) for s in model.steps] == [16, 16, 7]
    for i, predicted in enumerate(model.predicted):
        assert predicted == model.steps[i + 1:], (i, predicted)
