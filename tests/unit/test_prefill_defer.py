"""The loop ``prefill_defer`` holds steps of back is the one reviewed: mlx-lm's ``generate_step``
drops its prefill steps' output and reads the caches there only to evaluate their state (and
to quantize them, which turns holding back off). A new mlx-lm that changes that loop fails
here (and holding back turns itself off until it is reviewed)."""

from __future__ import annotations

import ast
import inspect
import textwrap

from mlx_lm.generate import generate_step

from cachecd_engine import prefill_defer

REVIEW = ("mlx_lm.generate_step changed: check that its prefill loop still drops each step's "
          "output and reads the caches only through c.state and quantize_cache_fn, then update "
          "prefill_defer.REVIEWED_SHA256")


def _loop() -> ast.While:
    tree = ast.parse(textwrap.dedent(inspect.getsource(generate_step)))
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.While)
             and "total_prompt_tokens" in ast.unparse(n.test)]
    assert len(loops) == 1, REVIEW
    return loops[0]


def test_generate_step_is_the_reviewed_loop() -> None:
    assert prefill_defer.loop_reviewed(), REVIEW


def test_the_loop_drops_the_steps_output() -> None:
    loop = _loop()
    calls = [n for n in ast.walk(loop) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == "_model_call"]
    assert len(calls) == 1, REVIEW
    dropped = [s for s in loop.body if isinstance(s, ast.Expr) and s.value is calls[0]]
    assert dropped, REVIEW  # a bare statement: nothing keeps the output


def test_the_loop_reads_the_caches_only_to_evaluate_them() -> None:
    uses = [ast.unparse(s) for s in _loop().body if "prompt_cache" in ast.unparse(s)]
    assert uses == ["quantize_cache_fn(prompt_cache)",
                    "mx.eval([c.state for c in prompt_cache])"], REVIEW


SPECULATIVE = ("mlx_lm.speculative_generate_step changed: check that its _prefill still drops "
               "each step's output and reads the caches only through c.state and "
               "quantize_cache_fn, and that its first _step is one call, then update "
               "prefill_defer.REVIEWED_SPECULATIVE_SHA256")


def test_speculative_generate_step_is_the_reviewed_loop() -> None:
    from mlx_lm.generate import speculative_generate_step

    assert prefill_defer._source_sha256(speculative_generate_step) \
        == prefill_defer.REVIEWED_SPECULATIVE_SHA256, SPECULATIVE
    tree = ast.parse(textwrap.dedent(inspect.getsource(speculative_generate_step)))
    prefill = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
               and n.name == "_prefill"]
    assert len(prefill) == 1, SPECULATIVE
    loop = next(n for n in ast.walk(prefill[0]) if isinstance(n, ast.While))
    calls = [s for s in loop.body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
             and ast.unparse(s.value.func) == "model"]
    assert len(calls) == 1, SPECULATIVE  # a bare statement: nothing keeps the output
    uses = [ast.unparse(s) for s in loop.body if "cache" in ast.unparse(s)
            and "clear_cache" not in ast.unparse(s)]
    assert uses == ["model(y[:n_to_process][None], cache=cache)", "quantize_cache_fn(cache)",
                    "mx.eval([c.state for c in cache])"], SPECULATIVE
