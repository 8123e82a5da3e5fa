"""Several machines, played on one: the tiny K3 pipelined over two ranks with mlx.distributed's
ring backend on 127.0.0.1 (``mlx.launch -n 2 --backend ring``), each rank installed with
``setup --stream --pipeline R/2`` and streaming through its own daemon with its own cache.

What is checked: the two ranks generate exactly what one machine does (greedy tokens, and the
logits each token was picked from, bitwise against the single-machine streamed engine and mlx-lm
with every weight resident); each daemon only ever held experts of its own layers and refuses
the others; a trace recorded on one machine warms each rank with its own layers, so the
pipelined run fetches nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.harness import TINY_REPO, HubProcess, Installed, run_cli, short_tmp

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Experts stream from the hub into a verified cache, layer after layer."
TOKENS = 6
LAYERS = {0: (3, 6), 1: (0, 3)}  # what mlx-lm's pipeline gives 2 ranks of the 6-layer tiny K3


class Ranks:
    """Two ranks installed on this machine: one daemon, cache and socket each."""

    def __init__(self, endpoint: str, manifest: Path) -> None:
        self.base = short_tmp("cdp")
        self.setup_out = {}
        for rank in LAYERS:
            self.setup_out[rank] = run_cli(
                "setup", "--stream", TINY_REPO, "--pipeline", f"{rank}/2", "--endpoint", endpoint,
                "--socket", str(self.socket(rank)), "--cache-dir", str(self.cache(rank)),
                "--models-dir", str(self.base / "models"), "--manifest", str(manifest)).stdout

    def socket(self, rank: int | str) -> Path:
        return self.base / str(rank) / "s.sock"

    def cache(self, rank: int) -> Path:
        return self.base / f"cache{rank}"

    def client(self, rank: int) -> Any:
        from cachecd_client import Client

        return Client(self.socket(rank))

    def cleanup(self) -> None:
        for rank in LAYERS:
            try:
                with self.client(rank) as c:
                    os.kill(c.health()["pid"], signal.SIGTERM)
            except Exception:  # noqa: BLE001 - already gone
                continue
            for _ in range(400):
                if not self.socket(rank).exists():
                    break
                time.sleep(0.05)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def ranks(hub: HubProcess, tiny_manifest_path: Path) -> Iterator[Ranks]:
    r = Ranks(hub.url, tiny_manifest_path)
    yield r
    r.cleanup()


def free_port_pair() -> int:
    """A port P with P and P+1 free: the ring backend listens on one port per rank."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise AssertionError("no two consecutive free ports on 127.0.0.1")


def launch(*command: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``mlx.launch -n 2 --backend ring`` on this machine, as a user runs it."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    proc = subprocess.run(
        [str(launcher), "-n", "2", "--backend", "ring", "--starting-port", str(free_port_pair()),
         "--cwd", str(ROOT), "--", sys.executable, *command],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (f"mlx.launch exited {proc.returncode}\n{proc.stdout}\n"
                                  f"{proc.stderr}")
    return proc


def held_layers(ranks: Ranks, rank: int, manifest: Any) -> set[int]:
    """The layers of every expert blob in the rank's cache dir (content-addressed by digest)."""
    layer_of = {manifest.digest_hex(r): int(manifest.layer_ids[r])
                for r in range(manifest.n_experts)}
    blobs = [p.name for p in (ranks.cache(rank) / "blobs").rglob("*") if p.is_file()]
    assert all(b in layer_of for b in blobs)
    return {layer_of[b] for b in blobs}


def test_setup_installs_each_rank_its_layers(ranks: Ranks, tiny_manifest: Any) -> None:
    for rank, (start, end) in LAYERS.items():
        out = ranks.setup_out[rank]
        assert f"pipeline rank {rank} of 2: layers {start}-{end - 1} of 6" in out
        with ranks.client(rank) as c:
            info = c.model(TINY_REPO)
        assert info["layers"] == [start, end] and info["pipeline"] == {"rank": rank, "size": 2}
        resident = Path(info["local_dir"]) / "model-resident.safetensors"
        assert resident.parent.name == f"pipeline-{rank}-of-2"  # two ranks never share a file
        from safetensors import safe_open

        with safe_open(str(resident), framework="numpy") as f:
            names = set(f.keys())
        layers = {int(n.split(".layers.")[1].split(".")[0]) for n in names if ".layers." in n}
        assert layers == set(range(start, end))
        assert any("embed_tokens" in n for n in names) and any("lm_head" in n for n in names)


def test_two_ranks_generate_what_one_machine_does(ranks: Ranks, installed_module: Installed,
                                                  tiny_resident: Any, tiny_manifest: Any) -> None:
    from tests.pipeline_rank import greedy_with_logits

    trace = ranks.base / "one-machine.jsonl"
    args = ["--model", TINY_REPO, "--prompt", PROMPT, "--max-tokens", str(TOKENS), "--json",
            "--no-chat"]
    one = json.loads(run_cli("run", *args, "--socket", str(installed_module.socket),
                             "--trace", str(trace)).stdout)
    # A trace recorded on one machine warms each rank with its own layers only.
    for rank in LAYERS:
        warmed = run_cli("warm", "--model", TINY_REPO, "--socket", str(ranks.socket(rank)),
                         "--trace", str(trace), "--json")
        assert "are other layers'" in warmed.stderr
        assert json.loads(warmed.stdout.splitlines()[-1])["hit_rate_after"] == 1.0

    two = launch("-m", "cachecd.cli", "run", *args, "--socket", str(ranks.socket("{rank}")))
    got = json.loads(two.stdout)  # rank 0 alone prints
    assert got["tokens"] == one["tokens"] and got["text"] == one["text"]
    assert all(len(t["per_rank"]) == 2 for t in got["per_token"])
    # Each rank's own figures: one call per MoE layer of its own a decoded token (the first
    # token's also count the prefill), and the sum over the ranks.
    moe = {r: len(set(tiny_manifest.moe_layers) & set(range(*LAYERS[r]))) for r in LAYERS}
    for t in got["per_token"][1:]:
        assert [t["per_rank"][r]["layer_calls"] for r in (0, 1)] == [moe[0], moe[1]]
        assert t["layer_calls"] == moe[0] + moe[1]
    assert sum(t["per_rank"][r]["source_hits"] for t in got["per_token"] for r in (0, 1)) > 0
    # All decode tokens warmed by the trace. The first token's may fetch: the one-machine run
    # prefilled layer by layer, where the last layer's experts of the prompt's earlier steps are
    # never read (nor recorded), while a pipelined model prefills on mlx-lm's loop, whose streamed
    # last layer reads them (docs/engine.md, "Prefill layer by layer").
    assert all(t["fetched_upstream"] == 0 for t in got["per_token"][1:])
    assert "rank 0: cache:" in two.stderr and "rank 1: cache:" in two.stderr

    out = ranks.base / "logits-{rank}.npz"
    launch("-m", "tests.pipeline_rank", str(ranks.socket("{rank}")), str(out), PROMPT, str(TOKENS))
    alone = ranks.base / "alone.npz"
    subprocess.run([sys.executable, "-m", "tests.pipeline_rank", str(installed_module.socket),
                    str(alone), PROMPT, str(TOKENS)], cwd=ROOT, check=True, timeout=300,
                   capture_output=True)
    ref_tokens, ref_logits = greedy_with_logits(*tiny_resident, PROMPT, TOKENS)
    # One row per decode step (mlx-lm computes the step after the last token ahead, too).
    assert ref_logits.shape[1] == 384 and len(ref_logits) >= TOKENS
    single = np.load(alone)
    assert single["tokens"].tolist() == ref_tokens == one["tokens"]
    assert np.array_equal(single["logits"], ref_logits)
    for rank, (start, end) in LAYERS.items():
        pipelined = np.load(str(out).replace("{rank}", str(rank)))
        assert pipelined["tokens"].tolist() == ref_tokens
        assert np.array_equal(pipelined["logits"], ref_logits)  # bitwise: max |diff| = 0.0
        assert set(pipelined["layers"].tolist()) == set(tiny_manifest.moe_layers) & set(
            range(start, end))

    for rank, (start, end) in LAYERS.items():
        held = held_layers(ranks, rank, tiny_manifest)
        assert held and held <= set(range(start, end))
        with ranks.client(rank) as c:
            store = c.stats()["store"]
            assert store["evictions"] == 0 and store["inserts"] == store["entries"]
            assert c.coverage(TINY_REPO)["served_layers"] == [start, end]


def test_a_rank_daemon_refuses_other_layers(ranks: Ranks) -> None:
    import cachecd_engine
    from cachecd.errors import LayerNotServed, NotStreamable

    with ranks.client(1) as c:
        before = c.stats()["store"]["inserts"]
        for ask in (lambda: c.experts(TINY_REPO, 4, [0]), lambda: c.warm(TINY_REPO, 3, [1]),
                    lambda: c.prefetch(TINY_REPO, 5, [2])):
            with pytest.raises(LayerNotServed, match="layers 0-2 \\(pipeline rank 1 of 2\\)"):
                ask()
        assert c.stats()["store"]["inserts"] == before
        status = run_cli("status", "--socket", str(ranks.socket(1))).stdout
        assert "serves    layers 0-2 only (pipeline rank 1 of 2)" in status
    with pytest.raises(NotStreamable, match="run it under mlx.launch with 2 ranks"):
        cachecd_engine.load(TINY_REPO, socket=ranks.socket(1))


def test_openai_under_mlx_launch_serves_from_rank_0_alone(ranks: Ranks, tiny_resident: Any) -> None:
    """`mlx.launch ... cachecd openai`: rank 0 binds the port and answers, rank 1 computes its
    layers for each request (no second server, no "Address already in use"), and the greedy
    answer is mlx-lm's."""
    from mlx_lm import generate

    openai = pytest.importorskip("openai")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = Path(sys.executable).parent / "mlx.launch"
    proc = subprocess.Popen(
        [str(launcher), "-n", "2", "--backend", "ring", "--starting-port", str(free_port_pair()),
         "--cwd", str(ROOT), "--", sys.executable, "-m", "cachecd.cli", "openai", "--model",
         TINY_REPO, "--socket", str(ranks.socket("{rank}")), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        start_new_session=True)
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        assert f"at http://127.0.0.1:{port}/v1" in banner, banner
        assert "pipelined over 2 ranks" in banner, banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        with ranks.client(1) as c:
            before = c.stats()["counters"].get("expert_requests", 0)
        got = client.completions.create(model=TINY_REPO, prompt=PROMPT, max_tokens=TOKENS,
                                        temperature=0)
        model, tokenizer = tiny_resident
        assert got.choices[0].text == generate(model, tokenizer, PROMPT, max_tokens=TOKENS)
        with ranks.client(1) as c:  # rank 1 computed its layers for it, through its daemon
            assert c.stats()["counters"]["expert_requests"] > before
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
    assert "Address already in use" not in err, err
    assert "cachecd openai: serving" not in out, out  # one banner: rank 0's
    assert "rank 0: cache:" in err and "rank 1: cache:" in err, err
