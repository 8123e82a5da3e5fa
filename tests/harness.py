"""Real processes for functional tests: `cachecd hub serve` and `cachecd serve` as a user runs them.

Sockets live under short /tmp dirs (a Unix socket path has a 108-byte limit).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote

CACHECD = [sys.executable, "-m", "cachecd.cli"]
_REQUEST = re.compile(r"request method=(\w+) path=(\S+) status=(\d+)")
TINY_REPO = "cachecd/tiny-k3"


_MADE: list[Path] = []  # every dir short_tmp made in this process


def short_tmp(prefix: str = "cd") -> Path:
    """A new dir under /tmp, removed at the end of a session that passed (kept for a look after
    a failure)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    _MADE.append(path)
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago: for a server to bind, or
    for a client to find closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def remove_short_tmps() -> None:
    while _MADE:
        shutil.rmtree(_MADE.pop(), ignore_errors=True)


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [*CACHECD, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"cachecd {' '.join(args)} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


class HubProcess:
    """`cachecd hub serve ROOT` on 127.0.0.1, port chosen by the OS."""

    def __init__(self, root: Path, token: str | None = None, extra: list[str] = ()) -> None:  # type: ignore[assignment]
        args = (["hub", "serve", str(root), "--port", "0"] + (["--token", token] if token else [])
                + list(extra))
        self.proc = subprocess.Popen(
            [*CACHECD, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        match = re.search(r"(http://\S+)", line)
        if not match:
            self.stop()
            raise AssertionError(f"hub serve printed {line!r}")
        self.url = match.group(1).rstrip("/")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class LoggedHub:
    """`cachecd -v hub serve ROOT`, its debug log (each request answered, each file hashed) in a
    file the test reads."""

    def __init__(self, root: Path, args: list[str] = ()) -> None:  # type: ignore[assignment]
        self.log_path = short_tmp("cdlh") / "hub.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([*CACHECD, "-v", "hub", "serve", str(root), "--port", "0",
                                      *args], stdout=subprocess.PIPE, stderr=self._log, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        match = re.search(r"(http://\S+)", line)
        assert match, f"hub serve printed {line!r}"
        self.url = match.group(1)

    def requests(self, since: int = 0) -> list[tuple[str, str, int]]:
        """(method, unquoted path, status) of every request answered, from line ``since`` on."""
        lines = self.log_path.read_text(errors="replace").splitlines()[since:]
        return [(m[1], unquote(m[2]), int(m[3])) for line in lines if (m := _REQUEST.search(line))]

    def mark(self) -> int:
        return len(self.log_path.read_text(errors="replace").splitlines())

    def log(self, since: int = 0) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()[since:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()
        shutil.rmtree(self.log_path.parent, ignore_errors=True)


class DaemonProcess:
    """`cachecd serve` with its own cache dir and socket; started healthy or the test fails."""

    def __init__(
        self,
        endpoint: str,
        manifests: list[Path] = (),
        *,
        cache_dir: Path | None = None,
        socket: Path | None = None,
        args: list[str] = (),
        env: dict[str, str] | None = None,
        preexec_fn: Any = None,
    ) -> None:
        self.base = short_tmp("cdd")
        self.preexec_fn = preexec_fn  # run in the child before exec (e.g. a lower fd limit)
        self.cache_dir = cache_dir or self.base / "cache"
        self.socket = socket or self.base / "run" / "s.sock"
        self.log_path = self.base / "daemon.log"
        self.endpoint = endpoint
        self.manifests = list(manifests)
        self.extra = list(args)
        self.env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def argv(self) -> list[str]:
        argv = [
            *CACHECD,
            "serve",
            "--cache-dir",
            str(self.cache_dir),
            "--socket",
            str(self.socket),
            "--endpoint",
            self.endpoint,
            "--models-dir",
            str(self.base / "models"),
        ]
        for m in self.manifests:
            argv += ["--manifest", str(m)]
        return argv + self.extra

    def start(self, timeout: float = 60, poll: float = 0.05) -> DaemonProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=log, env=self.env,
                                         preexec_fn=self.preexec_fn)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            if self._healthy():
                return self
            time.sleep(poll)
        raise AssertionError(f"daemon not healthy after {timeout}s:\n{self.log()}")

    def _healthy(self) -> bool:
        from cachecd.errors import DaemonUnavailable
        from cachecd_client import Client

        try:
            with Client(self.socket, timeout=5) as c:
                return bool(c.health().get("ok"))
        except DaemonUnavailable:
            return False

    def client(self, **kw: Any) -> Any:
        from cachecd_client import Client

        return Client(self.socket, **kw)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon ignored signal {sig} for {timeout}s:\n{self.log()}") from None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        shutil.rmtree(self.base, ignore_errors=True)


def keep_headers(models_dir: Path, manifest: Any, repo_dir: Path, endpoint: str) -> None:
    """What `cachecd setup --stream` leaves for the daemon it registers a model with: each
    shard's safetensors header, kept by ``endpoint`` and the shard's sha256 (read here from the
    checkpoint), so the daemon's layout check needs no request of the hub."""
    from cachecd.manifest.headers import endpoint_id, keep_dir

    keep = keep_dir(models_dir)
    keep.mkdir(parents=True, exist_ok=True)
    for name in manifest.shards:
        with open(repo_dir / name, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            f.seek(0)
            head = f.read(8 + n)
        (keep / f"{endpoint_id(endpoint)}-{manifest.files[name].sha256}.header").write_bytes(head)


def expert_bytes_from_files(repo_dir: Path, entry: Any) -> bytes:
    """An expert's bytes read straight from the checkpoint, independently of the daemon."""
    out = bytearray()
    for r in entry.ranges:
        with open(repo_dir / r.file, "rb") as f:
            f.seek(r.start)
            out += f.read(r.end - r.start)
    return bytes(out)


def stop_daemon(socket: Path) -> None:
    """SIGTERM the daemon that answers on ``socket`` (as a supervisor would) and wait until its
    socket is gone. DaemonUnavailable if none answers."""
    from cachecd_client import Client

    with Client(socket) as c:
        pid = c.health()["pid"]
    os.kill(pid, signal.SIGTERM)
    for _ in range(400):
        if not socket.exists():
            return
        time.sleep(0.05)
    raise AssertionError(f"daemon {pid} did not stop")


class Installed:
    """What `cachecd setup --stream` installs: the resident model and the daemon it started."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.socket = base / "run" / "s.sock"

    @classmethod
    def setup(cls, endpoint: str, manifest: Path, repo: str = TINY_REPO) -> Installed:
        inst = cls(short_tmp("cdi"))
        out = run_cli("setup", "--stream", repo, "--endpoint", endpoint, "--socket", str(inst.socket),
                      "--cache-dir", str(inst.base / "cache"), "--models-dir",
                      str(inst.base / "models"), "--manifest", str(manifest)).stdout
        assert "installed" in out and "started a daemon" in out
        return inst

    def client(self) -> Any:
        from cachecd_client import Client

        return Client(self.socket)

    def stop(self) -> None:
        from cachecd.errors import DaemonUnavailable

        try:
            stop_daemon(self.socket)
        except DaemonUnavailable:
            return

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)


class OpenAIServer:
    """`cachecd openai` on 127.0.0.1, port chosen by the OS; stopped with SIGTERM as a supervisor
    would, and expected to exit 0."""

    def __init__(self, repo: str, socket: Path, *args: str) -> None:
        self.log_path = short_tmp("cdo") / "openai.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*CACHECD, "openai", "--model", repo, "--socket", str(socket), "--port", "0", *args],
                stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        match = re.search(r"(http://\S+)", line)
        if not match:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"cachecd openai printed {line!r}:\n{self.log()}")
        self.url = match.group(1)  # ends in /v1, as the openai client's base_url

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"cachecd openai ignored SIGTERM:\n{self.log()}") from None
        if self.proc.stdout:
            self.proc.stdout.close()
        shutil.rmtree(self.log_path.parent, ignore_errors=True)
        return self.proc.returncode


# mlx_lm.server's own main(), on port 0, saying which port it bound (its log says "port 0"). A
# port chosen beforehand can be taken by another process (other suites on the machine) before
# the server binds it; the bind then fails in mlx-lm's main thread while its generation thread
# keeps the process up, and a wait for it to answer there waits on whoever holds the port.
_RESIDENT_MAIN = """
import socketserver, sys
from mlx_lm import server
activate = socketserver.TCPServer.server_activate
def report(self):
    activate(self)
    print(f"resident server listening on port {self.server_address[1]}", file=sys.stderr,
          flush=True)
socketserver.TCPServer.server_activate = report
sys.argv[0] = "mlx_lm.server"
server.main()
"""
_LISTENING = re.compile(r"resident server listening on port (\d+)")


class ResidentServer:
    """mlx_lm.server itself over a resident checkpoint (the reference for `cachecd openai`), on
    a port of 127.0.0.1 the OS chose; it listens before the constructor returns, or the test
    fails with its log."""

    def __init__(self, model_dir: Path, *args: str, timeout: float = 120) -> None:
        self.log_path = short_tmp("mls") / "server.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _RESIDENT_MAIN, "--model", str(model_dir),
                 "--port", "0", *args], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not (port := _LISTENING.search(self.log())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"mlx_lm.server did not listen:\n{self.log()}")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{port.group(1)}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def pool_bytes(model_dir: Path, repo: str, fraction: int = 1) -> int:
    """``--ram`` for a pool of ``1/fraction`` of one MoE layer's experts of the checkpoint in
    ``model_dir`` (at least two)."""
    from cachecd_engine.loader import load
    from cachecd_engine.local_source import LocalSource, manifest_from_dir

    manifest = manifest_from_dir(model_dir, repo=repo)
    with LocalSource(manifest, model_dir, verify=False) as source:
        model, _ = load(model_dir, source, ram_bytes=1, prefetch=False, speculate=False)
        bank = model.bank
        size = int(max(2, bank.experts_per_layer // fraction) * bank.slot_nbytes)
        bank.close()
    return size
