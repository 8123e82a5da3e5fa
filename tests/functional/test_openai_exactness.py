"""`cachecd openai` prefills layer by layer, exactly: every logprob it answers is resident
mlx_lm.server's at the same ``--prefill-step-size``.

For each format the exactness tests cover (mxfp4 and fp32 tiny K3, int4 and fp8 tiny K2), the
checkpoint is served by `cachecd hub serve`, installed by `cachecd setup --stream` (its daemon
on a Unix socket), and served by `cachecd openai --prefill-step-size S` with a pool of a third
of a layer's experts (so each layer's calls of all the steps are computed group by group,
``pool.chunks``); the same checkpoint fully resident is served by mlx-lm's own server with the
same step size. Through the official openai client both are asked, greedily with the top
logprobs, for completions of prompts of 1, 2 and 5 prefill steps (``steps * S + 1`` tokens:
the steps, then the last token's), on both of mlx-lm's paths in the server: batched
(``BatchGenerator``, a request without a seed) and alone (``stream_generate``, with a seed).

Every returned token and logprob must be equal (float equality, no tolerance). Both servers
compute the logprobs from the logits with the same mlx ops and print them as JSON floats, which
round-trip a Python float (the widened float32 value) exactly: bitwise-equal logits print the
same answers, and logits that differ move the log-sum-exp every logprob is taken from, so they
show in the prompt's last position and every decoded one (save for a rounding coincidence).

Both step sizes of the drop-in path's test (tests/functional/test_prefill_layer_major.py), 16
and 7, for every format: one daemon a format, one pair of servers a step size. The prompts start
with different bytes (the tiny tokenizer's tokens), so mlx-lm's prompt cache holds no prefix of
any of them and each is prefilled whole (both servers' usage says so). That the streamed server
ran the prefill layer by layer is read from its log: a line for the end of each pass
(``prefill layer N/N``).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.exactness import formats_served
from tests.harness import (
    HubProcess,
    Installed,
    OpenAIServer,
    ResidentServer,
    pool_bytes,
    run_cli,
    short_tmp,
)

openai = pytest.importorskip("openai")

REPOS = {
    "mxfp4": "cachecd/tiny-k3-mxfp4",
    "fp32": "cachecd/tiny-k3-fp32",
    "int4": "cachecd/tiny-k2-int4",
    "fp8": "cachecd/tiny-k2-fp8",
}
STEP_SIZES = (16, 7)
STEPS = (1, 2, 5)
N = 3  # greedy tokens a request
TOP = 10  # top logprobs a token (mlx-lm's server allows up to 11)
TEXT = ("layer after layer, every chunk of the prompt meets the experts once; the cache streams "
        "them from the hub, verified, and the logits stay the resident model's, bit for bit. ")
FIRST = {"batched": "ABC", "alone": "XYZ"}  # each prompt's first byte: no prefix in common
PASS_END = re.compile(r"prefill layer (\d+)/\1:")


@pytest.fixture(scope="module")
def formats_hub() -> Iterator[tuple[Path, HubProcess]]:
    """One `cachecd hub serve` over the four checkpoints."""
    with formats_served("cdoe", REPOS) as served:
        yield served


@dataclass
class Install:
    fmt: str
    repo: str
    full: Path
    installed: Installed  # `cachecd setup --stream`'s install, and the daemon it started
    ram: str  # --ram: a third of a layer's experts


class Installs:
    """Each format installed when its first pair of servers needs it; one at a time (the pairs
    come format by format), the one before cleaned up."""

    def __init__(self, root: Path, hub: HubProcess) -> None:
        self.root, self.hub = root, hub
        self.current: Install | None = None
        self._manifest_dir: Path | None = None

    def get(self, fmt: str) -> Install:
        if self.current is not None and self.current.fmt == fmt:
            return self.current
        self.cleanup()
        repo, url = REPOS[fmt], self.hub.url
        self._manifest_dir = short_tmp("cdoem")
        manifest = self._manifest_dir / "model.manifest"
        run_cli("manifest", "build", f"{repo}@main", "--endpoint", url, "--output", str(manifest))
        installed = Installed.setup(url, manifest, repo)
        full = self.root / repo
        self.current = Install(fmt, repo, full, installed, str(pool_bytes(full, repo, 3)))
        return self.current

    def cleanup(self) -> None:
        if self.current is not None:
            self.current.installed.cleanup()
            self.current = None
        if self._manifest_dir is not None:
            shutil.rmtree(self._manifest_dir, ignore_errors=True)
            self._manifest_dir = None


@pytest.fixture(scope="module")
def installs(formats_hub: tuple[Path, HubProcess]) -> Iterator[Installs]:
    made = Installs(*formats_hub)
    yield made
    made.cleanup()


@dataclass
class Pair:
    fmt: str
    step: int
    full: Path
    tokenizer: Any
    streamed: OpenAIServer
    ours: Any  # openai clients
    resident: Any


@pytest.fixture(scope="module", params=[(f, s) for f in REPOS for s in STEP_SIZES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request: pytest.FixtureRequest, installs: Installs) -> Iterator[Pair]:
    """`cachecd openai` over the format's daemon and mlx_lm.server over the resident
    checkpoint, both at one step size."""
    from mlx_lm.utils import load_tokenizer

    fmt, step = installs.get(request.param[0]), request.param[1]
    flags = ("--prefill-step-size", str(step))
    streamed = OpenAIServer(fmt.repo, fmt.installed.socket, *flags, "--ram", fmt.ram)
    resident = None
    try:
        resident = ResidentServer(fmt.full, *flags)
        yield Pair(fmt.fmt, step, fmt.full, load_tokenizer(fmt.full), streamed,
                   *(openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=300)
                     for s in (streamed, resident)))
    finally:
        if resident is not None:
            resident.stop()
        assert streamed.stop() == 0, streamed.log()


def prompt_of(tokenizer: Any, first: str, n: int) -> str:
    """A text the server's tokenizer encodes to exactly ``n`` tokens, starting with ``first``."""
    text = first + TEXT * (1 + n // 40)
    while len(tokenizer.encode(text)) > n:
        text = text[:-1]
    assert len(tokenizer.encode(text)) == n, "the tokenizer cannot make this length"
    return text


def complete(client: Any, model: str, prompt: str, seed: int | None) -> Any:
    extra: dict[str, Any] = {"logprobs": True, "top_logprobs": TOP}  # mlx-lm's names and types
    if seed is not None:
        extra["seed"] = seed  # mlx-lm's server then generates alone (stream_generate)
    return client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0,
                                     extra_body=extra)


def tokens_and_logprobs(answer: Any) -> list[dict[str, Any]]:
    """Each generated token's id, logprob and top logprobs, as the server printed them."""
    content = answer.choices[0].logprobs.model_extra["content"]
    assert len(content) == N and all(len(t["top_logprobs"]) == TOP for t in content), content
    return content


@pytest.mark.parametrize("path", ["batched", "alone"])
def test_logprobs_bitwise_resident_mlx_lm_server(pair: Pair, path: str) -> None:
    seed = None if path == "batched" else 0
    for first, steps in zip(FIRST[path], STEPS, strict=True):
        tokens = steps * pair.step + 1
        prompt = prompt_of(pair.tokenizer, first, tokens)
        what = f"{pair.fmt}, {path}, step {pair.step} x {steps}"
        ends = len(PASS_END.findall(pair.streamed.log()))
        got = complete(pair.ours, REPOS[pair.fmt], prompt, seed)
        want = complete(pair.resident, str(pair.full), prompt, seed)
        # Prefilled whole, on both sides (no prefix of it in either prompt cache).
        view = got.usage.model_extra["cachecd"]
        assert view["prompt_tokens_prefilled"] == tokens and view["prompt_tokens_cached"] == 0, \
            (what, view)
        details = want.usage.prompt_tokens_details
        assert want.usage.prompt_tokens == tokens and details is not None and \
            details.cached_tokens == 0, (what, want.usage)
        # Layer by layer: one pass for the prompt, but for the batched path's lone step, which
        # runs as it is (a pass of one step would make the same calls).
        passes = len(PASS_END.findall(pair.streamed.log())) - ends
        assert passes == (0 if path == "batched" and steps == 1 else 1), \
            (what, pair.streamed.log()[-3000:])
        ref = tokens_and_logprobs(want)
        # Not trivial: each token's top logprobs differ from the next's.
        assert len({tuple(a["logprob"] for a in t["top_logprobs"]) for t in ref}) == N, ref
        assert tokens_and_logprobs(got) == ref, what
        assert got.choices[0].text == want.choices[0].text, what
