"""The production ExpertSource: every expert byte comes through the cachecd daemon.

The engine reads experts only through the daemon (fd data path, zero copy); the manifest it
parses them with is the one the daemon registered, fetched from the daemon too, so engine and
daemon always agree on the revision. Prefetch hints are fire-and-forget on one background
thread: a slow or failed hint never delays or changes a token.

Every expert read is checked against the manifest's xxh3-128 as it lands (``verify``, on by
default): the client hashes each window on its reader threads right after the read, so a blob
that rotted in place is never computed from. One that fails is reported to the daemon, which
hashes it again and quarantines it, and is read (fetched) again before the read returns.

A daemon that stops answering mid-read (restarted by hand, by ``service install``, after a
crash) is waited for: the demand read says so on the log once and every ``_SAY_EVERY_S`` (the
line names the socket and how to start a daemon), asks the daemon's health until it answers, and
is sent again, for up to ``constants.DAEMON_RETURN_S``; then it fails with
``DaemonUnavailable``. A read of the same experts returns the same verified bytes, so sending it
again changes nothing it computes. Read-ahead is a guess and is never waited for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cachecd import constants
from cachecd.errors import CachecdError, DaemonUnavailable, ExpertSizeMismatch, ModelNotFound
from cachecd.manifest.entries import ExpertEntry
from cachecd.manifest.manifest import Manifest

log = logging.getLogger(__name__)

_SAY_EVERY_S = 5.0


class DaemonSource:
    def __init__(self, client: Any, repo: str, manifest: Manifest,
                 info: dict[str, Any] | None = None) -> None:
        self.client = client
        self.repo = repo
        self.manifest = manifest
        self.info = info or {}  # the daemon's description of the registration (layers served)
        self.hints_failed = 0
        #: check every expert's bytes against the manifest's xxh3-128 as they land (benches
        #: turn it off to measure what it costs)
        self.verify = True
        self._hints = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cachecd-hint")

    @classmethod
    def connect(cls, repo: str, socket: str | Path | None = None) -> tuple[DaemonSource, Path]:
        """The source for a registered model, and the local dir holding its resident files."""
        from cachecd_client import Client

        client = Client(socket)
        try:
            info = client.model(repo)
            if not info.get("local_dir"):
                raise ModelNotFound(f"{repo} is registered without resident files; run "
                                    f"`cachecd setup --stream {repo}`")
            manifest = Manifest.from_bytes(client.manifest_bytes(repo), f"daemon:{repo}")
        except BaseException:
            client.close()  # a server asked for many unknown names must not keep their sockets
            raise
        return cls(client, repo, manifest, info), Path(info["local_dir"])

    def entry(self, layer: int, expert: int) -> ExpertEntry:
        return self.manifest.expert(layer, expert)

    def read_into(self, layer: int, ids: list[int], targets: Sequence[Sequence[memoryview]],
                  landed: Callable[[int, int], None] | None = None) -> int:
        """Read the experts into ``targets``; the bytes written (the transport fills exactly
        the sizes the daemon sends, or raises), each expert's checked against its digest.
        ``landed(i, n)`` as the first ``n`` bytes of expert ``i`` are in place, window by
        window, in order; an expert read again after its bytes failed their check lands again
        from its start (``n`` falls back)."""
        return self._checked(layer, ids, self._while_down(
            lambda: self.client.experts_into(self.repo, layer, ids, targets, landed,
                                             digests=self._digests(layer, ids))))

    def read_ahead_into(self, layer: int, ids: list[int],
                        targets: Sequence[Sequence[memoryview]]) -> int:
        """``read_into`` for read-ahead: on the client's read-ahead threads, so no demand read
        waits behind it."""
        return self._checked(layer, ids, self.client.experts_into(
            self.repo, layer, ids, targets, ahead=True, digests=self._digests(layer, ids)))

    def _digests(self, layer: int, ids: list[int]) -> list[bytes | None] | None:
        """The experts' xxh3-128 as the manifest has them; None with ``verify`` off. A manifest
        made from headers has none of its own: the digests the daemon has learnt from proven
        bytes are asked for (and kept) the first time an expert is read; one it has not learnt
        yet is being fetched and proven for this very read, and is checked from the next."""
        if not self.verify:
            return None
        m = self.manifest
        rows = [m.row(layer, e) for e in ids]
        if m.learns and (ask := [e for e, r in zip(ids, rows, strict=True) if m.unlearnt(r)]):
            for e, digest in zip(ask, self.client.digests(self.repo, layer, ask), strict=True):
                if digest is not None:
                    m.learn(m.row(layer, e), digest)
        return [None if m.unlearnt(r) else m.digests[r].tobytes() for r in rows]

    def _while_down(self, read: Callable[[], list[int]]) -> list[int]:
        """``read()``, sent again once a daemon that stopped answering is back, within
        ``constants.DAEMON_RETURN_S`` of its first failure; else its ``DaemonUnavailable``."""
        since: float | None = None
        while True:
            try:
                got = read()
            except DaemonUnavailable as exc:
                since = time.monotonic() if since is None else since
                if not self._back(since):
                    raise DaemonUnavailable(
                        f"the cachecd daemon on {self.client.socket} stopped answering and did "
                        f"not come back in {constants.DAEMON_RETURN_S:.0f} s; start it with "
                        "`cachecd serve` (foreground) or `cachecd service install`, then "
                        "ask again") from exc
                continue
            if since is not None:
                log.warning("the cachecd daemon on %s answers again after %.0f s: reading on",
                            self.client.socket, time.monotonic() - since)
            return got

    def _back(self, since: float) -> bool:
        """Wait until the daemon answers its health check (True) or the wait is over (False),
        saying so now and every ``_SAY_EVERY_S``."""
        said = 0.0
        while (waited := time.monotonic() - since) < constants.DAEMON_RETURN_S:
            if waited >= said:
                said = waited + _SAY_EVERY_S
                log.warning("the cachecd daemon on %s does not answer: waiting %.0f s of %.0f "
                            "for it to come back; start it with `cachecd serve` or `cachecd "
                            "service install`", self.client.socket, waited,
                            constants.DAEMON_RETURN_S)
            try:
                self.client.health()
                return True
            except DaemonUnavailable:
                time.sleep(constants.DAEMON_RETURN_POLL_S)
        return False

    def _checked(self, layer: int, ids: list[int], sizes: list[int]) -> int:
        """The bytes written, each expert's as the manifest says, else ``ExpertSizeMismatch``."""
        for e, size in zip(ids, sizes, strict=True):
            if size != self.manifest.expert(layer, e).nbytes:
                raise ExpertSizeMismatch(
                    f"daemon served {size} bytes for layer {layer} expert {e}; the manifest "
                    f"says {self.manifest.expert(layer, e).nbytes}"
                )
        return sum(sizes)

    def prefetch(self, layer: int, ids: list[int]) -> None:
        self._hints.submit(self._hint, layer, list(ids))

    def _hint(self, layer: int, ids: list[int]) -> None:
        try:
            self.client.prefetch(self.repo, layer, ids)
        except CachecdError as exc:
            self.hints_failed += 1
            log.debug("prefetch hint failed layer=%d err=%s", layer, exc.code)

    def close(self) -> None:
        self._hints.shutdown(wait=False)
        self.client.close()
