"""`cachecd openai`'s batched path (mlx-lm's ``BatchGenerator``: every request without a seed,
the tiny K3's caches merge) prefills layer by layer: through the official openai client, two
requests at once answer mlx_lm.server's text over the resident checkpoint, and each request's
reads (``usage.cachecd``) are a pass over each layer's experts, not one a prefill step; a
streamed request's keepalive comments keep coming once a layer during the pass.

The pool holds one layer's experts (``--ram``), the steps are 16 tokens (a prompt here is 8 or
9 steps), so step by step each step reads its experts again (the old way: several times the
bound asserted here).
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import TINY_REPO, Installed, OpenAIServer, ResidentServer, pool_bytes

openai = pytest.importorskip("openai")

STEP = 16
TOP_K, MOE_LAYERS, EXPERTS, LAYERS = 4, 5, 32, 6  # the tiny model: the first layer dense
# Of equal lengths (the tiny tokenizer's bytes): sent together, one batch with no padded step.
PROMPTS = ["Experts stream from the hub into a verified cache, layer after layer, " * 2,
           "A long prompt reads each layer's experts once, whatever the step is.. " * 2]
N = 4


@pytest.fixture(scope="module")
def servers(installed_module: Installed, tiny_dir: Path) -> Iterator[tuple[Any, Any, Any]]:
    flags = ("--prefill-step-size", str(STEP))
    ours = OpenAIServer(TINY_REPO, installed_module.socket, *flags,
                        "--ram", str(pool_bytes(tiny_dir, TINY_REPO)))
    resident = ResidentServer(tiny_dir, *flags)
    try:
        yield ours, *(openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0,
                                    timeout=300) for s in (ours, resident))
    finally:
        resident.stop()
        assert ours.stop() == 0, ours.log()


def at_once(client: Any, model: str) -> list[Any]:
    """The two prompts sent together (greedy, no seed: mlx-lm's batched path)."""
    answers: list[Any] = [None, None]

    def send(i: int) -> None:
        answers[i] = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=N,
                                               temperature=0)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a is not None for a in answers)
    return answers


def test_two_requests_at_once_read_each_layer_once_and_answer_mlx_lm(
        servers: tuple[Any, Any, Any], tiny_dir: Path) -> None:
    srv, ours, resident = servers
    got = at_once(ours, TINY_REPO)
    want = at_once(resident, str(tiny_dir))
    assert [a.choices[0].text for a in got] == [a.choices[0].text for a in want]
    for answer in got:
        view = answer.usage.model_extra["cachecd"]
        assert view["prompt_tokens_prefilled"] > 7 * STEP, view  # 8 steps or more
        # One pass over the MoE layers but the last where both came together; if the second
        # came while the first prefilled, the first's pass, one for the two merged and one
        # for the second's rest, and the steps step by step between (a padded one, one that
        # leaves a last token alone): at most four passes' worth. Then the decode steps' rows
        # (both requests', the last prompt token's and one computed ahead: N + 1 steps). Step
        # by step it is each of the 18 prefill steps' experts, in every MoE layer.
        bound = 4 * MOE_LAYERS * EXPERTS + (N + 1) * MOE_LAYERS * 2 * TOP_K
        assert 0 < view["experts_read"] <= bound, view
    # The pass's progress in the server's log, as on the one-request path.
    assert re.search(rf"prefill layer {LAYERS}/{LAYERS}: \d+ experts read", srv.log()), \
        srv.log()[-3000:]


def test_keepalives_keep_coming_during_a_batched_pass(servers: tuple[Any, Any, Any]) -> None:
    """A streamed request on the batched path: its first step runs all its steps layer by
    layer, and its keepalive comment (the step's progress) comes once a layer meanwhile, then
    once as the step returns; the other steps' come as they replay."""
    srv = servers[0]
    prompt = "Keepalive comments keep a client waiting through a long prefill. " * 2  # unseen
    body = json.dumps({"model": TINY_REPO, "prompt": prompt, "max_tokens": 2,
                       "temperature": 0, "stream": True}).encode()
    request = urllib.request.Request(f"{srv.url}/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        lines = [raw.decode().strip() for raw in answer]
    events = [ln for ln in lines if ln.startswith((": keepalive", "data:"))]
    first_data = next(i for i, ln in enumerate(events) if ln.startswith("data:"))
    alive = [tuple(map(int, re.findall(r"\d+", ln))) for ln in events[:first_data]]
    assert alive and all(ln.startswith(": keepalive") for ln in events[:first_data])
    total = alive[-1][1]
    assert total > 7 * STEP, alive
    assert alive.count((STEP, total)) >= 1 + LAYERS, alive  # step by step: once


def test_a_follow_up_prefills_only_its_new_tokens_layer_by_layer(
        servers: tuple[Any, Any, Any], tiny_dir: Path) -> None:
    """A next turn on the batched path: mlx-lm's prompt cache gives it the first turn's caches
    (prompt and answer), so only its new tokens are prefilled (``usage.cachecd`` says so), in
    one pass: at most each expert of each MoE layer but the last once, and the decode's."""
    _, ours, resident = servers
    first = "A chat's next turn sends the whole conversation again, every time. " * 2
    one = ours.completions.create(model=TINY_REPO, prompt=first, max_tokens=N, temperature=0)
    turn = first + one.choices[0].text + " And the next turn asks one more thing of it, too."
    two = ours.completions.create(model=TINY_REPO, prompt=turn, max_tokens=N, temperature=0)
    want = resident.completions.create(model=str(tiny_dir), prompt=turn, max_tokens=N,
                                       temperature=0)
    assert two.choices[0].text == want.choices[0].text
    view = two.usage.model_extra["cachecd"]
    # the first turn's prompt and answer came from the cache (the tiny tokenizer's bytes
    # round-trip); only the rest went through the model, 3 steps of 16 and its last token
    assert view["prompt_tokens_cached"] == one.usage.prompt_tokens + N, view
    assert view["prompt_tokens_prefilled"] == two.usage.prompt_tokens - view[
        "prompt_tokens_cached"] > 2 * STEP, view
    bound = (MOE_LAYERS - 1) * EXPERTS + (N + 1) * MOE_LAYERS * TOP_K
    assert 0 < view["experts_read"] <= bound, view
