"""Settings that stick (issue 36): what `cachecd setup` was told comes back at every later start
of its daemon, a model remembers the endpoint it was installed from, and setup refuses what
cannot work before it does anything. Each step is a command a user runs, against a real daemon
and the local hub.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import (
    CACHECD,
    TINY_REPO,
    HubProcess,
    LoggedHub,
    free_port,
    run_cli,
    short_tmp,
    stop_daemon,
)

RUN = ("run", "--model", TINY_REPO, "--prompt", "Hello", "--max-tokens", "1")


def token_file(base: Path) -> Path:
    path = base / "token"
    path.write_text("ab" * 32)
    path.chmod(0o600)
    return path


def bare_serve(socket: Path, *extra: str, log: Path) -> subprocess.Popen[bytes]:
    """`cachecd serve --socket S` with nothing else: what it serves with is what was recorded."""
    from cachecd.errors import DaemonUnavailable
    from cachecd_client import Client

    with open(log, "ab") as out:
        proc = subprocess.Popen([*CACHECD, "serve", "--socket", str(socket), *extra],
                                stdout=out, stderr=out)
    for _ in range(1200):
        assert proc.poll() is None, log.read_text()
        try:
            with Client(socket, timeout=5) as c:
                if c.health().get("ok"):
                    return proc
        except DaemonUnavailable:
            time.sleep(0.05)
    raise AssertionError(f"no daemon on {socket}:\n{log.read_text()}")


@pytest.fixture
def base() -> Iterator[Path]:
    path = short_tmp("cdst")
    yield path
    try:
        stop_daemon(path / "run" / "s.sock")
    except Exception:
        pass
    shutil.rmtree(path, ignore_errors=True)


def setup(base: Path, endpoint: str, manifest: Path, *extra: str,
          check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_cli("setup", "--stream", TINY_REPO, "--endpoint", endpoint,
                   "--socket", str(base / "run" / "s.sock"), "--manifest", str(manifest),
                   "--models-dir", str(base / "models"), *extra, check=check)


def status(socket: Path) -> str:
    return run_cli("status", "--socket", str(socket)).stdout


def test_what_setup_was_told_comes_back_at_a_bare_serve_and_in_the_service_unit(
        hub: HubProcess, tiny_manifest_path: Path, base: Path) -> None:
    socket, token = base / "run" / "s.sock", token_file(base)
    share, peer = f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    out = setup(base, hub.url, tiny_manifest_path, "--cache-dir", str(base / "cache"),
                "--budget", "64MiB",
                "--share", share, "--share-token-file", str(token),
                "--peer", peer, "--peer-token-file", str(token)).stdout
    assert "recorded" in out, out
    run_cli("stop", "--socket", str(socket))

    daemon = bare_serve(socket, log=base / "serve.log")
    try:
        said = status(socket)
        assert f"endpoint    {hub.url}" in said, said
        assert f"cache       {base / 'cache'}" in said and "of a 64.0 MiB budget" in said, said
        assert f"peer        {peer}" in said and "sharing" in said, said
        assert TINY_REPO in said  # the models dir was recorded too: the model is still there

        unit = run_cli("service", "render", "--platform", "systemd", "--socket", str(socket)).stdout
        exec_start = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
        for word in (f"--endpoint {hub.url}", f"--share {share}", f"--peer {peer}",
                     f"--cache-dir {base / 'cache'}"):
            assert word in exec_start, exec_start

        same = run_cli("service", "install", "--dry-run", "--platform", "systemd",
                       "--socket", str(socket)).stdout
        assert f"--endpoint {hub.url}" in same
        assert "runs with the same settings as this unit" in same, same
        other = run_cli("service", "install", "--dry-run", "--platform", "systemd",
                        "--socket", str(socket), "--endpoint", "http://127.0.0.1:9",
                        "--budget", "1GiB").stdout
        assert "differs from this unit in 2 setting(s)" in other, other
        assert f"#   endpoint: running {hub.url}, unit http://127.0.0.1:9" in other, other
        assert f"#   budget: running {64 << 20}, unit {1 << 30}" in other, other

        # The next setup keeps what the first recorded, and says what waits for a restart.
        again = run_cli("setup", "--stream", TINY_REPO, "--socket", str(socket),
                        "--manifest", str(tiny_manifest_path), "--budget", "128MiB").stdout
        assert f"budget {128 << 20} (it runs with {64 << 20})" in again, again
        assert f"endpoint    {hub.url}" in status(socket)
    finally:
        daemon.terminate()
        daemon.wait(30)


def test_a_model_is_fetched_only_from_the_endpoint_it_was_installed_from(
        hub: HubProcess, hub_root: Path, tiny_manifest_path: Path, base: Path) -> None:
    socket = base / "run" / "s.sock"
    setup(base, hub.url, tiny_manifest_path, "--cache-dir", str(base / "cache"))
    other = LoggedHub(hub_root)  # the same files, another endpoint
    try:
        # Setup against a daemon that fetches from elsewhere is refused before it installs.
        refused = setup(base, other.url, tiny_manifest_path, check=False)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "endpoint_mismatch" in refused.stderr and hub.url in refused.stderr
        run_cli("stop", "--socket", str(socket))

        log = base / "serve.log"
        daemon = bare_serve(socket, "--endpoint", other.url, log=log)
        try:
            said = log.read_text()
            assert "event=endpoint_mismatch" in said and hub.url in said, said
            assert f"installed from {hub.url}, not {other.url}" in status(socket)
            mark = other.mark()
            ran = run_cli(*RUN, "--socket", str(socket), check=False)
            line = ran.stderr.strip().splitlines()[-1]
            assert ran.returncode == 1 and line.startswith("cachecd: endpoint_mismatch:"), ran
            assert hub.url in line and other.url in line and "--allow-other-endpoint" in line
            assert not [r for r in other.requests(mark) if "/resolve/" in r[1]]
        finally:
            daemon.terminate()
            daemon.wait(30)

        # Told: the experts come from the other endpoint, verified all the same.
        daemon = bare_serve(socket, "--endpoint", other.url, "--allow-other-endpoint", log=log)
        try:
            mark = other.mark()
            run_cli(*RUN, "--socket", str(socket))
            assert [r for r in other.requests(mark) if "/resolve/" in r[1]]
        finally:
            daemon.terminate()
            daemon.wait(30)
    finally:
        other.stop()


def test_a_read_only_cache_dir_is_refused_before_the_hub_is_asked(
        hub_root: Path, tiny_manifest_path: Path, base: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a read-only dir")
    cache = base / "ro"
    cache.mkdir()
    hub = LoggedHub(hub_root)
    try:
        argv = [*CACHECD, "setup", "--stream", TINY_REPO, "--endpoint", hub.url, "--socket",
                str(base / "run" / "s.sock"), "--cache-dir", str(cache), "--models-dir",
                str(base / "models"), "--manifest", str(tiny_manifest_path)]
        script = f'mount --bind -o ro "{cache}" "{cache}" && exec "$@"'
        proc = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *argv],
                              capture_output=True, text=True, timeout=300, env=os.environ)
        if "mount" in proc.stderr and "cachecd" not in proc.stderr:
            pytest.skip(f"cannot mount a read-only dir here: {proc.stderr.strip()}")
        line = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert line.startswith(f"cachecd: config_invalid: --cache-dir {cache}: cannot write"), line
        assert "Read-only file system" in line and "writable" in line
        assert hub.requests() == []  # nothing resolved, nothing hashed
        assert not (base / "models").exists() and not (base / "run" / "s.sock").exists()
    finally:
        hub.stop()


def largest_layer_bytes(manifest_path: Path) -> int:
    """Every expert of a layer: what a 2,048-token step of the tiny model (top-4 of 32) needs."""
    from cachecd.manifest.manifest import Manifest

    m = Manifest.load(manifest_path)
    return max(int(m.sizes[m.layer_ids == layer].sum()) for layer in m.moe_layers)


def test_a_budget_below_one_prefill_step_is_refused_at_setup_and_named_at_run(
        hub: HubProcess, tiny_manifest_path: Path, base: Path) -> None:
    from cachecd.sizes import format_size

    need, socket = largest_layer_bytes(tiny_manifest_path), base / "run" / "s.sock"
    small = setup(base, hub.url, tiny_manifest_path, "--cache-dir", str(base / "cache"),
                  "--budget", "100KiB", check=False)
    assert small.returncode == 1, small.stdout + small.stderr
    line = small.stderr.strip().splitlines()[-1]
    assert line.startswith("cachecd: config_invalid:"), line
    assert f"({format_size(need)})" in line, line
    assert "smallest working budget is" in line and "--budget" in line, line
    assert not socket.exists()  # refused before a daemon was started

    # The budget named works: a prompt's prefill runs within it.
    named = re.search(r"pass --budget (\S+) or more", line)
    assert named, line
    setup(base, hub.url, tiny_manifest_path, "--cache-dir", str(base / "cache"),
          "--budget", named.group(1))
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    run_cli("run", "--model", TINY_REPO, "--socket", str(socket), "--prompt", prompt,
            "--max-tokens", "2")
    run_cli("stop", "--socket", str(socket))

    # A daemon told a smaller budget by hand starts, says so, and a prompt names the fix.
    log = base / "serve.log"
    daemon = bare_serve(socket, "--budget", "100KiB", log=log)
    try:
        assert "event=budget_too_small" in log.read_text()
        ran = run_cli("run", "--model", TINY_REPO, "--socket", str(socket), "--prompt", prompt,
                      "--max-tokens", "1", check=False)
        last = ran.stderr.strip().splitlines()[-1]
        assert ran.returncode == 1 and last.startswith("cachecd: budget_too_small:"), ran.stderr
        assert "--budget" in last and "--prefill-step-size" in last, last
        assert "Retry shortly" not in last
    finally:
        daemon.terminate()
        daemon.wait(30)
