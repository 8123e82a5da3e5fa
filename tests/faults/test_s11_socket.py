"""Scenario 11: socket permissions and the peer uid check.

The socket dir is 0700 and both sockets 0600 the first moment they exist (stat from a thread
polling every 0.2 ms while the daemon starts). uid 65534 (setpriv) gets EACCES. With the modes
widened by hand it gets through the file modes, and SO_PEERCRED refuses it: 403 on the control
socket, a forbidden frame on the data socket, a log line with its uid and pid. A stale socket
file is removed, a live one or a regular file is not, and a second daemon on the same cache dir
exits non-zero.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

from tests.faults.figures import FIGURES
from tests.faults.support import FaultDaemon, Model, fetch_verified, new_dir
from tests.other_uid import NOBODY, OtherUid

_AS_NOBODY = r"""
import json, socket, struct, sys
ctl, data = sys.argv[1], sys.argv[2]
out = {}
for name, path in (("control", ctl), ("data", data)):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    try:
        s.connect(path)
    except OSError as exc:
        out[name] = {"connect_errno": exc.errno}
        continue
    if name == "control":
        req = b"GET /healthz HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n"
    else:
        body = json.dumps({"op": "experts", "model": "faults/small", "layer": 1, "ids": [0]}).encode()
        req = struct.pack(">I", len(body)) + body
    try:
        s.sendall(req)
    except BrokenPipeError:  # the data path refuses before reading: its answer is still queued
        pass
    buf = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:  # refused before its request was read: answer, then RST
            break
        if not chunk:
            break
        buf += chunk
    out[name] = {"answer": buf.decode("utf-8", "replace")}
print(json.dumps(out))
"""


def _as_nobody(d: FaultDaemon, nobody: OtherUid) -> dict:  # type: ignore[type-arg]
    proc = subprocess.run(
        nobody.argv("-I", "-c", _AS_NOBODY, str(d.socket), str(d.socket) + ".data"),
        capture_output=True, text=True, timeout=60, cwd="/", env=nobody.env())
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _modes(path: Path) -> tuple[int, int, int]:
    return (stat.S_IMODE(os.lstat(path.parent).st_mode), stat.S_IMODE(os.lstat(path).st_mode),
            stat.S_IMODE(os.lstat(str(path) + ".data").st_mode))


def test_modes_from_bind_nobody_refused_then_forbidden(small: Model, pool, as_nobody) -> None:  # type: ignore[no-untyped-def]
    nobody = as_nobody()  # its client code needs the stdlib only
    hub = pool.hub(small)
    d = pool.daemon(hub, [small], start=False)
    first: list[tuple[int, int, int]] = []

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                first.append(_modes(d.socket))
                return
            except FileNotFoundError:
                time.sleep(0.0002)

    w = threading.Thread(target=watch)
    w.start()
    d.start()
    w.join()
    dir_mode, ctl_mode, data_mode = first[0]
    FIGURES.set("s11.modes_at_first_sight",
                f"dir {dir_mode:o}, control {ctl_mode:o}, data {data_mode:o}")
    assert first[0] == (0o700, 0o600, 0o600), first
    refused = _as_nobody(d, nobody)
    assert refused["control"] == {"connect_errno": 13} and refused["data"] == {"connect_errno": 13}
    FIGURES.set("s11.nobody_with_normal_modes", ", ".join(
        f"{name} {errno.errorcode[got['connect_errno']]}" for name, got in sorted(refused.items())))
    d.base.chmod(0o711)  # the test's own temp dir, above the socket dir
    d.socket.parent.chmod(0o755)
    d.socket.chmod(0o666)
    os.chmod(str(d.socket) + ".data", 0o666)
    try:
        let_in = _as_nobody(d, nobody)
    finally:
        d.base.chmod(0o700)
        d.socket.parent.chmod(0o700)
        d.socket.chmod(0o600)
        os.chmod(str(d.socket) + ".data", 0o600)
    head, _, body = let_in["control"]["answer"].partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 403"), head
    control_error = json.loads(body)["error"]
    assert control_error == "forbidden"
    assert '"error":"forbidden"' in let_in["data"]["answer"]
    data_answer = let_in["data"]["answer"]
    data_error = json.loads(data_answer[data_answer.index("{"):])["error"]  # past the length
    log = d.log()
    assert f"peer refused uid={NOBODY} pid=" in log and f"data peer refused uid={NOBODY}" in log
    lines = len(re.findall(rf"peer refused uid={NOBODY} pid=\d+", log))
    FIGURES.set("s11.nobody_with_widened_modes",
                f"control {head.split()[1]} {control_error}, data {data_error}, "
                f"{lines} log lines with uid and pid")
    with d.client() as c:  # the owner is still served
        fetch_verified(c, small, small.layers[0], [0])


def _stale_socket(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the file stays; connect() now fails with ECONNREFUSED


def _finished(proc: subprocess.Popen[str]) -> tuple[str, int]:
    try:
        return proc.communicate(timeout=60)[0], proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0], 0  # it started and served: the assertion below says so


def test_stale_socket_is_removed_live_socket_and_file_are_not(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    stale = new_dir("cds") / "run" / "s.sock"
    _stale_socket(stale)
    d = pool.daemon(hub, [small], socket=stale)  # starts: the stale file is cleared
    assert "stale socket removed" in d.log()
    # Three daemons that must refuse to start, run side by side to save time.
    live_path = new_dir("cds") / "run" / "s.sock"
    live_path.parent.mkdir(mode=0o700)
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(live_path))
    live.listen(1)
    plain = new_dir("cds") / "run" / "s.sock"
    plain.parent.mkdir(mode=0o700)
    plain.write_text("not a socket")
    cases = {
        "live socket": pool.daemon(hub, [small], socket=live_path, start=False),
        "regular file": pool.daemon(hub, [small], socket=plain, start=False),
        "same cache dir": pool.daemon(hub, [small], cache_dir=d.cache_dir, start=False),
    }
    procs = {k: subprocess.Popen(v.argv, env=v.env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for k, v in cases.items()}
    outs = {k: _finished(p) for k, p in procs.items()}
    live.close()
    for what, (out, code) in outs.items():
        assert code != 0, f"{what}: a second daemon started\n{out}"
        FIGURES.set(f"s11.refused_start_{what.replace(' ', '_')}", f"exit {code}")
    assert "cache_locked" in outs["live socket"][0] and live_path.exists()
    assert "config_invalid" in outs["regular file"][0] and plain.read_text() == "not a socket"
    assert "cache_locked" in outs["same cache dir"][0]
    with d.client() as c:  # the first daemon never noticed
        fetch_verified(c, small, small.layers[0], [1])


def test_existing_socket_dir_is_used_as_it_is_never_changed(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    """`serve --socket DIR/x.sock` chmods only a DIR it creates: an existing 0755 DIR (as /run)
    serves unchanged; one others may write to (as /tmp, 1777) is refused, its mode untouched."""
    hub = pool.hub(small)
    shared = new_dir("cds") / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    d = pool.daemon(hub, [small], socket=shared / "s.sock")
    with d.client() as c:
        fetch_verified(c, small, small.layers[0], [1])
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    assert stat.S_IMODE((shared / "s.sock").stat().st_mode) == 0o600
    made = new_dir("cds") / "made" / "deeper"
    pool.daemon(hub, [small], socket=made / "s.sock")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700  # created: 0700 whatever the umask
    sticky = new_dir("cds") / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    refused = pool.daemon(hub, [small], socket=sticky / "s.sock", start=False)
    proc = subprocess.Popen(refused.argv, env=refused.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out, code = _finished(proc)
    assert code != 0 and "config_invalid" in out and "writable by others" in out, out
    assert len([ln for ln in out.splitlines() if "writable by others" in ln]) == 1, out
    assert stat.S_IMODE(sticky.stat().st_mode) == 0o1777
    FIGURES.set("s11.existing_socket_dirs",
                f"{stat.S_IMODE(shared.stat().st_mode):o} served, unchanged; "
                f"{stat.S_IMODE(sticky.stat().st_mode):o} refused (exit {code}), unchanged")
