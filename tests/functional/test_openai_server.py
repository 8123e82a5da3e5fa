"""`cachecd openai` as a user runs it, answered through the official openai client: its model's
experts stream through a real daemon (set up by `cachecd setup --stream` from `cachecd hub serve`),
and its greedy text is mlx-lm's on the fully resident checkpoint."""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness import TINY_REPO, Installed, OpenAIServer, run_cli
from tests.lora import write_adapter

openai = pytest.importorskip("openai")

PROMPT = "Experts stream from the hub into a verified cache, layer after layer."
CHAT = [{"role": "user", "content": "Which experts does this token need?"}]
N = 24
TOP_K, MOE_LAYERS = 4, 5  # the tiny model: 4 of 32 experts a token, 6 layers, the first dense


@pytest.fixture(scope="module")
def server(installed_module: Installed) -> Iterator[OpenAIServer]:
    # --ram 0: every expert a request uses is read through the daemon, so the counts show it.
    srv = OpenAIServer(TINY_REPO, installed_module.socket, "--ram", "0")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: OpenAIServer) -> Any:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def resident_text(tiny_resident: Any, prompt: Any, max_tokens: int = N) -> str:
    from mlx_lm import generate

    model, tokenizer = tiny_resident
    return generate(model, tokenizer, prompt, max_tokens=max_tokens)


def resident_chat(tiny_resident: Any, messages: list[dict[str, str]]) -> str:
    tokenizer = tiny_resident[1]
    assert tokenizer.chat_template  # the tiny tokenizer has one (cachecd/tiny_tokenizer.py)
    return resident_text(tiny_resident, tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def test_models_lists_the_served_model(client: Any) -> None:
    assert [m.id for m in client.models.list()] == [TINY_REPO]
    assert client.models.retrieve(TINY_REPO).id == TINY_REPO
    with pytest.raises(openai.NotFoundError, match="cachecd setup --stream"):
        client.models.retrieve("nobody/nothing")


def test_completion_equals_resident_mlx_lm_streamed_and_not(client: Any, tiny_resident: Any) -> None:
    want = resident_text(tiny_resident, PROMPT)
    raw = client.completions.with_raw_response.create(
        model=TINY_REPO, prompt=PROMPT, max_tokens=N, temperature=0)
    done = raw.parse()
    assert done.choices[0].text == want
    view = done.usage.model_extra["cachecd"]
    assert int(raw.headers["x-cachecd-fetched-experts"]) == view["experts_fetched"]
    assert view["experts_from_daemon"] + view["experts_read_ahead"] > 0  # --ram 0: all via daemon
    chunks = list(client.completions.create(model=TINY_REPO, prompt=PROMPT, max_tokens=N,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    streamed = chunks[-1].usage.model_extra["cachecd"]
    # the same prompt again: mlx-lm's prompt cache holds all of it but the last token
    assert streamed["prompt_tokens_prefilled"] == 1, streamed
    assert streamed["prompt_tokens_cached"] == chunks[-1].usage.prompt_tokens - 1, streamed


def test_chat_equals_resident_mlx_lm_streamed_and_not(client: Any, tiny_resident: Any) -> None:
    want = resident_chat(tiny_resident, CHAT)
    done = client.chat.completions.create(model=TINY_REPO, messages=CHAT, max_tokens=N, temperature=0)
    assert done.choices[0].message.content == want
    stream = client.chat.completions.create(model=TINY_REPO, messages=CHAT, max_tokens=N,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_two_requests_at_once(client: Any, tiny_resident: Any) -> None:
    """The second request is sent once the first has streamed its first token and while it has
    many more to go, so the two overlap for certain: each must see the other in flight (the test
    fails if they never overlap), and each answer is still mlx-lm's."""
    prompts = [PROMPT, "A second prompt, routed to other experts at the same time."]
    long = 160
    first = client.completions.create(model=TINY_REPO, prompt=prompts[0], max_tokens=long,
                                      temperature=0, stream=True,
                                      stream_options={"include_usage": True})
    chunks = [next(first)]  # the first is answering: its window is open
    got: dict[str, Any] = {}
    second = threading.Thread(target=lambda: got.update(second=client.completions.create(
        model=TINY_REPO, prompt=prompts[1], max_tokens=N, temperature=0)))
    second.start()
    chunks += list(first)
    second.join(120)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == resident_text(tiny_resident, prompts[0], long)
    assert got["second"].choices[0].text == resident_text(tiny_resident, prompts[1])
    assert chunks[-1].usage.completion_tokens == long  # it was still going when the second came
    others = [chunks[-1].usage.model_extra["cachecd"]["other_requests"],
              got["second"].usage.model_extra["cachecd"]["other_requests"]]
    assert others == [1, 1], others


def test_cold_request_counts_its_hub_fetches(client: Any, installed_module: Installed) -> None:
    with installed_module.client() as c:
        c.evict(nbytes=1 << 40)  # every expert: the next request fetches from the hub again
        assert c.coverage(TINY_REPO)["bytes_cached"] == 0
    prompt = "Cold again: every expert of this prompt comes from the hub."
    cold = client.completions.create(model=TINY_REPO, prompt=prompt, max_tokens=8, temperature=0)
    warm = client.completions.create(model=TINY_REPO, prompt=prompt, max_tokens=8, temperature=0)
    assert cold.usage.model_extra["cachecd"]["experts_fetched"] > 0
    assert warm.usage.model_extra["cachecd"]["experts_fetched"] == 0
    assert warm.choices[0].text == cold.choices[0].text


def test_unknown_model_browser_origin_and_n_above_1_are_refused(client: Any) -> None:
    with pytest.raises(openai.NotFoundError, match="cachecd setup --stream nobody/nothing"):
        client.completions.create(model="nobody/nothing", prompt="x", max_tokens=2)
    page = client.with_options(default_headers={"Origin": "https://example.com"})
    with pytest.raises(openai.PermissionDeniedError, match="--allowed-origins"):
        page.completions.create(model=TINY_REPO, prompt="x", max_tokens=2)
    for create, ask in ((client.completions.create, {"prompt": "x"}),
                        (client.chat.completions.create,
                         {"messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
            create(model=TINY_REPO, max_tokens=2, n=2, **ask)
    # the served model stayed loaded
    assert client.completions.create(model=TINY_REPO, prompt="x", max_tokens=2, n=1).choices


def test_what_cannot_be_served_fails_at_start(installed_module: Installed, server: OpenAIServer) -> None:
    socket = str(installed_module.socket)
    unknown = run_cli("openai", "--model", "nobody/nothing", "--socket", socket, check=False)
    port = server.url.rsplit(":", 1)[1].split("/")[0]
    taken = run_cli("openai", "--model", TINY_REPO, "--socket", socket, "--port", port, check=False)
    for proc, says in ((unknown, "cachecd setup --stream nobody/nothing"), (taken, "--port")):
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert says in proc.stderr.strip().splitlines()[-1]


def test_mlx_lm_server_flags_that_cannot_apply_are_refused_with_the_reason(
        installed_module: Installed) -> None:
    socket = str(installed_module.socket)
    for flags, says in ((["--kv-bits", "8"], "quantized KV cache cannot apply"),
                        (["--draft-model", "any/draft"], "cannot be trimmed")):
        proc = run_cli("openai", "--model", TINY_REPO, "--socket", socket, "--port", "0", *flags,
                       check=False)
        line = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert line.startswith(f"cachecd: config_invalid: {flags[0]}: ") and says in line, line


def test_the_prompt_cache_keeps_to_its_byte_bound(installed_module: Installed,
                                                 server: OpenAIServer, client: Any) -> None:
    """--prompt-cache-bytes bounds the KV caches kept for reuse (mlx-lm logs their count at each
    request; --log-level INFO, the default, shows it): one byte keeps none, where the unbounded
    server keeps each prompt's."""
    for _ in range(2):
        client.completions.create(model=TINY_REPO, prompt=PROMPT, max_tokens=2, temperature=0)
    assert re.search(r"Prompt Cache: [1-9]\d* sequences", server.log()), server.log()[-3000:]
    bound = OpenAIServer(TINY_REPO, installed_module.socket, "--prompt-cache-bytes", "1",
                         "--log-level", "INFO")
    try:
        small = openai.OpenAI(base_url=bound.url, api_key="unused", max_retries=0, timeout=120)
        for _ in range(2):
            small.completions.create(model=TINY_REPO, prompt=PROMPT, max_tokens=2, temperature=0)
        seen = [line for line in bound.log().splitlines() if "Prompt Cache:" in line]
        assert seen and all("Prompt Cache: 0 sequences" in line for line in seen), seen
    finally:
        assert bound.stop() == 0


def test_an_adapter_serves_its_text(installed_module: Installed, tiny_dir: Any) -> None:
    """--adapter-path (mlx_lm.lora's format, on resident weights): the answers are mlx-lm's with
    that adapter, request after request (the generation thread loads the model, as in
    mlx_lm.server: loaded elsewhere, its first request died on another thread's MLX stream)."""
    import shutil

    import mlx_lm

    adapter = write_adapter(tiny_dir, ["self_attn.o_proj", "mlp.shared_experts.down_proj"])
    srv = OpenAIServer(TINY_REPO, installed_module.socket, "--adapter-path", str(adapter))
    try:
        want = resident_text(mlx_lm.load(str(tiny_dir), adapter_path=str(adapter)), PROMPT)
        with_adapter = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0,
                                     timeout=120)
        for _ in range(2):
            done = with_adapter.completions.create(model=TINY_REPO, prompt=PROMPT, max_tokens=N,
                                                   temperature=0)
            assert done.choices[0].text == want, srv.log()[-3000:]
        # No "model" (as mlx_lm.server's own curl examples): the model as loaded at start.
        body = json.dumps({"prompt": PROMPT, "max_tokens": N, "temperature": 0}).encode()
        with urllib.request.urlopen(urllib.request.Request(
                f"{srv.url}/completions", body, {"Content-Type": "application/json"}),
                timeout=120) as answer:
            assert json.load(answer)["choices"][0]["text"] == want, srv.log()[-3000:]
    finally:
        assert srv.stop() == 0, srv.log()
        shutil.rmtree(adapter, ignore_errors=True)


def test_a_follow_up_prefills_only_its_new_tokens(installed_module: Installed) -> None:
    """A chat's second turn takes the first turn's KV caches from mlx-lm's prompt cache: only
    its new tokens go through the model (each routes to top_k experts in each MoE layer, so
    ``expert_rows`` counts the tokens that went through), and it reads fewer experts than
    the same full prompt sent to a server that keeps no prompt cache. Small prefill steps (16
    tokens) and --ram 0 (a pool of two experts)."""
    flags = ("--ram", "0", "--prefill-step-size", "16")
    keeps = OpenAIServer(TINY_REPO, installed_module.socket, *flags)
    fresh = OpenAIServer(TINY_REPO, installed_module.socket, *flags, "--prompt-cache-size", "0")
    try:
        chat, nothing_kept = (openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0,
                                            timeout=120) for s in (keeps, fresh))
        first = [{"role": "user", "content": "Tell me which experts a long prompt reads. " * 4}]
        one = chat.chat.completions.create(model=TINY_REPO, messages=first, max_tokens=N,
                                           temperature=0)
        turn = [*first, {"role": "assistant", "content": one.choices[0].message.content},
                {"role": "user", "content": "And the next turn?"}]
        two = chat.chat.completions.create(model=TINY_REPO, messages=turn, max_tokens=2,
                                           temperature=0)
        again = nothing_kept.chat.completions.create(model=TINY_REPO, messages=turn,
                                                     max_tokens=2, temperature=0)
        # a seed makes mlx-lm serve the request alone (generate_step's path, not the batch's)
        # (another next turn: this one's own prompt is cached now, all but its last token)
        other = [*turn[:2], {"role": "user", "content": "Or another next turn?"}]
        seeded = chat.chat.completions.create(model=TINY_REPO, messages=other, max_tokens=2,
                                              temperature=0, seed=0)
        answers = (one, two, again, seeded)
        assert two.choices[0].message.content == again.choices[0].message.content
        assert seeded.choices[0].message.content == nothing_kept.chat.completions.create(
            model=TINY_REPO, messages=other, max_tokens=2, temperature=0).choices[0].message.content
        views = [r.usage.model_extra["cachecd"] for r in answers]
        for r, v in zip(answers, views, strict=True):
            assert v["prompt_tokens_cached"] == r.usage.prompt_tokens_details.cached_tokens
            assert v["prompt_tokens_cached"] + v["prompt_tokens_prefilled"] == r.usage.prompt_tokens
            # every token that went through routes to TOP_K experts a MoE layer (the layer-major
            # prefill of generate_step's path skips the last layer for all but the last token)
            rows = (v["prompt_tokens_prefilled"] + r.usage.completion_tokens) * TOP_K
            assert rows * (MOE_LAYERS - 1) < v["expert_rows"] <= rows * MOE_LAYERS, (v, r.usage)
            assert 0 < v["experts_read"] <= v["experts_routed"], v
        # the first turn's prompt and answer came from the cache; only the rest was prefilled
        # (the tiny tokenizer's bytes round-trip: the answer is tokenized back as generated)
        assert views[1]["prompt_tokens_cached"] == one.usage.prompt_tokens + N, views[1]
        assert views[3]["prompt_tokens_cached"] == views[1]["prompt_tokens_cached"], views
        assert views[2]["prompt_tokens_cached"] == 0, views[2]
        # Only the new tokens went through the model: a third of the rows or fewer. The reads
        # are fewer too, but not by as much: with a pool of two experts the full prompt's
        # prefill takes each layer's steps together (pool.chunks) and reads each routed expert
        # of a layer once, as the follow-up's few tokens nearly do in a layer of 32 experts.
        for follow_up in (views[1], views[3]):
            assert follow_up["expert_rows"] * 3 < views[2]["expert_rows"], views
            assert follow_up["experts_read"] <= views[2]["experts_read"], views
            assert follow_up["bytes_from_daemon"] <= views[2]["bytes_from_daemon"], views
    finally:
        assert keeps.stop() == 0, keeps.log()
        assert fresh.stop() == 0, fresh.log()
