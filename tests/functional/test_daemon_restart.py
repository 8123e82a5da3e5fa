"""Every front door survives its daemon: `cachecd stop` then `cachecd serve` (real processes, as a
user restarts the daemon) under a running `cachecd openai`, asked through the official openai
client, and under a running `cachecd run`.

A request in flight while the daemon restarts waits for it and goes on (the engine's source
reconnects, saying so in the log); one that arrives while the daemon is down is refused with 503
and the command that starts one; a daemon away longer than the wait fails the requests in flight
with that error, and the server goes on serving once it is back; `/health` says down while the
daemon is down and up after.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from tests.harness import (
    CACHECD,
    TINY_REPO,
    Installed,
    OpenAIServer,
    run_cli,
    serve_bare,
    short_tmp,
)

openai = pytest.importorskip("openai")

PROMPT = "Experts stream from the hub into a verified cache, layer after layer."
LONG = 3000  # tokens: a stream still going when the daemon stops (the test closes it early)
WAITING = "does not answer: waiting"  # the engine's line while it waits for the daemon
BACK = "answers again after"
# The engine's wait for a daemon that went away (seconds): long enough for a restart on a busy
# machine, short enough for the test that lets it run out.
WAIT_S = "15"


def health(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def until(state: Callable[[], bool], what: str, proc: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not state():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}"
        assert time.monotonic() < deadline, f"not {what} after {timeout} s"
        time.sleep(0.05)


def ask(client: Any, max_tokens: int = 8) -> str:
    done = client.completions.create(model=TINY_REPO, prompt=PROMPT, max_tokens=max_tokens,
                                     temperature=0)
    return str(done.choices[0].text)


def test_openai_outlives_a_daemon_restart(installed_module: Installed,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECD_DAEMON_WAIT_S", WAIT_S)
    socket, logs = str(installed_module.socket), short_tmp("cdrs")
    # --ram 0: every token reads its experts through the daemon
    srv = OpenAIServer(TINY_REPO, installed_module.socket, "--ram", "0")
    client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=300)
    try:
        want = ask(client)
        assert health(srv.url)[0] == 200

        # Between requests: the daemon is down, and the server says so.
        run_cli("stop", "--socket", socket)
        status, body = health(srv.url)
        assert status == 503 and "cachecd serve" in body["message"], body
        with pytest.raises(openai.APIStatusError) as down:
            ask(client)
        assert down.value.status_code == 503, down.value
        assert "cachecd serve" in down.value.message and socket in down.value.message
        serve_bare(installed_module.socket, logs / "d1.log")
        assert health(srv.url)[0] == 200
        assert ask(client) == want

        # In flight: a stream goes on across a restart.
        stream = client.completions.create(model=TINY_REPO, prompt=PROMPT, max_tokens=LONG,
                                           temperature=0, stream=True)
        chunks = iter(stream)
        next(chunks)
        run_cli("stop", "--socket", socket)
        until(lambda: WAITING in srv.log(), "waiting for the daemon (the log)", srv.proc)
        serve_bare(installed_module.socket, logs / "d2.log")
        until(lambda: BACK in srv.log(), "back to reading (the log)", srv.proc)
        for _ in range(5):  # tokens after the restart come: the request lives
            next(chunks)
        stream.close()
        assert ask(client) == want

        # In flight while the daemon stays away past the wait: the request gets the error,
        # the server lives on and serves again once the daemon is back.
        stream = client.completions.create(model=TINY_REPO, prompt=PROMPT, max_tokens=LONG,
                                           temperature=0, stream=True)
        chunks = iter(stream)
        next(chunks)
        run_cli("stop", "--socket", socket)
        with pytest.raises(openai.APIError, match="did not come back"):
            for _ in chunks:
                pass
        assert health(srv.url)[0] == 503
        serve_bare(installed_module.socket, logs / "d3.log")
        assert health(srv.url)[0] == 200
        assert ask(client) == want
    finally:
        assert srv.stop() == 0, srv.log()


def test_run_reconnects_across_a_restart_and_says_so(installed_module: Installed,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECD_DAEMON_WAIT_S", WAIT_S)
    socket, logs = str(installed_module.socket), short_tmp("cdrr")
    err = logs / "run.err"
    with open(err, "wb") as out:
        proc = subprocess.Popen([*CACHECD, "run", "--socket", socket, "--prompt", PROMPT,
                                 "--max-tokens", str(LONG), "--ram", "0"],
                                stdout=subprocess.PIPE, stderr=out)
    try:
        assert proc.stdout is not None
        proc.stdout.read(1)  # the first token is out
        run_cli("stop", "--socket", socket)
        until(lambda: WAITING in err.read_text(), "waiting for the daemon (stderr)", proc)
        serve_bare(installed_module.socket, logs / "d.log")
        until(lambda: BACK in err.read_text(), "back to reading (stderr)", proc)
        assert proc.stdout.read(20)  # text after the restart: the run lives on
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 130, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_run_says_the_daemon_is_gone_and_exits_3(installed_module: Installed,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHECD_DAEMON_WAIT_S", "1")
    err = short_tmp("cdrg") / "run.err"
    with open(err, "wb") as out:
        proc = subprocess.Popen([*CACHECD, "run", "--socket", str(installed_module.socket), "--prompt",
                                 PROMPT, "--max-tokens", str(LONG), "--ram", "0"],
                                stdout=subprocess.PIPE, stderr=out)
    assert proc.stdout is not None
    proc.stdout.read(1)
    run_cli("stop", "--socket", str(installed_module.socket))
    proc.stdout.read()
    assert proc.wait(300) == 3, err.read_text()
    last = err.read_text().strip().splitlines()[-1]
    assert last.startswith("cachecd: daemon_unavailable:") and "cachecd serve" in last, last
    serve_bare(installed_module.socket, err.parent / "d.log")

