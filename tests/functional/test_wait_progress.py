"""A cold prompt's wait on the Hub, shown while it lasts: `cachecd run` prints, about once a
second while a layer's read waits on the daemon's fetches, the experts fetched of those under
way, bytes, rate and time left; `cachecd warm --prompts` shows the same beside its bar on a
terminal; `cachecd openai` logs it while a request waits. The Hub here is the local hub behind
a proxy that holds every expert range it is asked for until the test has seen the line (a state,
not a time), then lets them through."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import re
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.fakes.counting_proxy import CountingProxy
from tests.harness import CACHECD, TINY_REPO, Installed, OpenAIServer

WAIT_LINE = re.compile(r"layer (\d+): waiting (\d+) s on the daemon for (\d+) experts routed: "
                       r"(\d+) of (\d+) fetched from the Hub \((.+?) of (.+?)\), (.+?)/s, "
                       r"(about \d+ s left|no byte in yet)")
MOVED = re.compile(r"layer (\d+): waiting (\d+) s on the daemon for (\d+) experts routed: "
                   r"([1-9]\d*) of (\d+) fetched from the Hub \((.+?) of (.+?)\), (.+?)/s, "
                   r"about \d+ s left")  # some came, the rest on their way


class HoldingProxy(CountingProxy):
    """Holds range reads of the shards (or of their xorbs: the hub keeps them in Xet) while
    ``holding`` is set, but for ``let_through`` of them; ``held`` counts those held."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.holding = threading.Event()
        self.held = 0
        self.let_through = 0

    async def _forward(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.headers.get("Range") and (request.path.endswith(".safetensors")
                                             or request.path.startswith("/_xorb/")):
            if self.holding.is_set():
                self.held += 1
            while self.holding.is_set() and not self.let_through:
                await asyncio.sleep(0.02)
            if self.holding.is_set():
                self.let_through -= 1
        return await super()._forward(request)


@pytest.fixture
def held(hub: Any, tiny_manifest_path: Path) -> Iterator[tuple[Installed, HoldingProxy]]:
    proxy = HoldingProxy(hub.url).start()
    inst = Installed.setup(proxy.url, tiny_manifest_path)
    proxy.holding.set()  # from now on every expert fetch waits for the test
    try:
        yield inst, proxy
    finally:
        proxy.holding.clear()
        inst.cleanup()
        proxy.stop()


def _until_line(text: Any, pattern: re.Pattern[str], proc: subprocess.Popen[Any],
                timeout: float = 120.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := pattern.search(text()):
            return found
        assert proc.poll() is None, f"exited {proc.returncode} without the line:\n{text()[-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no wait line in {timeout}s:\n{text()[-3000:]}")


def _check(found: re.Match[str]) -> None:
    routed, fetched, of = int(found[3]), int(found[4]), int(found[5])
    assert routed > 0 and of > 0 and fetched <= of, found[0]


def test_run_shows_the_wait_on_the_hub(held: tuple[Installed, HoldingProxy]) -> None:
    inst, proxy = held
    proc = subprocess.Popen([*CACHECD, "run", "--model", TINY_REPO, "--socket", str(inst.socket),
                             "--prompt", "Experts stream in.", "--max-tokens", "2", "--no-chat"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")))
    reader.start()
    try:
        found = _until_line(lambda: "".join(lines), WAIT_LINE, proc)
        assert proxy.held > 0  # the line came while the fetch was held
        _check(found)
        # One request through, the rest still held: the layer's line counts what came, and
        # from its rate says how long the rest will take.
        proxy.let_through = 1
        _check(_until_line(lambda: "".join(lines), MOVED, proc))
    finally:
        proxy.holding.clear()
        out, _ = proc.communicate(timeout=300)
        reader.join()
    assert proc.returncode == 0, "".join(lines)[-3000:]
    assert out.strip()


def test_warm_prompts_shows_the_wait_beside_its_bar(held: tuple[Installed, HoldingProxy],
                                                    tmp_path: Path) -> None:
    inst, proxy = held
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Experts stream in.\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    main, term = pty.openpty()  # stderr on a terminal: the bar is drawn
    fcntl.ioctl(term, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 400, 0, 0))
    proc = subprocess.Popen([*CACHECD, "warm", "--model", TINY_REPO, "--socket", str(inst.socket),
                             "--prompts", str(prompts), "--max-new", "1", "--no-chat"],
                            stdout=subprocess.PIPE, stderr=term, env=env)
    os.close(term)
    seen = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal's other end closed: the child is done
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        beside = re.compile(r"prompt 1: " + WAIT_LINE.pattern)
        _check(_until_line(lambda: seen.decode(errors="replace"), beside, proc))
    finally:
        proxy.holding.clear()
        proc.communicate(timeout=300)
        reader.join()
        os.close(main)
    assert proc.returncode == 0, seen.decode(errors="replace")[-3000:]


def test_openai_logs_the_wait_on_the_hub(held: tuple[Installed, HoldingProxy]) -> None:
    openai = pytest.importorskip("openai")
    inst, proxy = held
    srv = OpenAIServer(TINY_REPO, inst.socket)
    client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=300)
    answers: list[Any] = []
    asking = threading.Thread(target=lambda: answers.append(client.completions.create(
        model=TINY_REPO, prompt="Experts stream in.", max_tokens=2)))
    asking.start()
    try:
        found = _until_line(srv.log, WAIT_LINE, srv.proc)  # while the request waits
        assert proxy.held > 0 and not answers
        _check(found)
    finally:
        proxy.holding.clear()
        asking.join(300)
        log = srv.log()
        code = srv.stop()
    assert code == 0 and answers and answers[0].usage.completion_tokens > 0, log[-3000:]
