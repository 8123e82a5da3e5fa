"""The cachecd client: experts by (model, layer, expert), prefetch hints, coverage, status.

Expert bytes come through the zero-copy data path: the daemon hands over open file descriptors
and the client reads them with ``preadv`` on a small thread pool, straight into the caller's
buffers. Errors are cachecd's own typed errors (``cachecd.errors``), raised exactly as the
daemon sent them; ``DaemonUnavailable`` when nothing listens.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from cachecd.config import data_socket_path, load_settings
from cachecd.errors import ChecksumMismatch, ExpertSizeMismatch, InvalidRequest, ModelNotFound
from cachecd.protocol import MAX_FDS_PER_FRAME
from cachecd_client.transport import ControlTransport, DataTransport, Target, parallel_preadv
from cachecd_client.waits import WaitProgress, WaitWatch

log = logging.getLogger(__name__)
Landed = Callable[[int, int], None]

def default_socket() -> Path:
    """The socket a daemon started with the same environment and config would use."""
    return load_settings().socket


def resolve_model(model: str | None, socket: str | Path | None = None) -> str:
    """``model`` if given, else the one model the daemon on ``socket`` has registered.

    Raises:
        ModelNotFound: none is registered.
        InvalidRequest: several are; the message lists them.
    """
    if model:
        return model
    with Client(socket) as client:
        repos = sorted({m["repo"] for m in client.models()})
    if len(repos) == 1:
        return repos[0]
    if not repos:
        raise ModelNotFound(f"no model is registered with the daemon on {client.socket}: install "
                            "one with `cachecd setup --stream ORG/NAME`")
    raise InvalidRequest(f"{len(repos)} models are registered with the daemon on {client.socket} "
                         f"({', '.join(repos)}): name one with --model ORG/NAME")


class Client:
    """A synchronous client. Thread-safe for ``experts``; one instance per process is enough.

    Args:
        socket: the daemon's control socket (default: from ``CACHECD_SOCKET``/config/defaults).
        timeout: seconds to wait for an answer; a cold miss on a slow link can take long.
        readers: threads reading expert bytes in parallel.
    """

    def __init__(self, socket: str | Path | None = None, *, timeout: float = 600.0,
                 readers: int = 4) -> None:
        self.socket = Path(socket) if socket else default_socket()
        self._control = ControlTransport(self.socket, timeout)
        self._data = DataTransport(data_socket_path(self.socket), timeout)
        self._pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="cachecd-read")
        # Reads of guesses (``ahead``) have threads of their own: a demand read never waits
        # in a queue behind them.
        self._ahead_pool = ThreadPoolExecutor(max_workers=max(1, readers // 2),
                                              thread_name_prefix="cachecd-read-ahead")
        #: experts that the daemon had to fetch upstream for this client's requests, so far
        self.upstream_fetches = 0
        #: experts whose bytes failed their digest as read (``experts_into(digests=...)``) and
        #: were read again, so far
        self.checksum_mismatches = 0
        #: reads are warming (``cachecd warm --prompts``): the daemon counts them as warm
        #: fetches, not as use (no access counts, no hits or misses)
        self.warming = False
        self._waits = WaitWatch(self.socket)

    # control ---------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """The daemon's health (``{"ok": true, "pid": ...}``)."""
        return self._control.request("GET", "/healthz")

    def stats(self, verbose: bool = False) -> dict[str, Any]:
        """Daemon status: store usage, counters, upstream stats, registered models (each with
        its experts cached and pinned; ``verbose``: the pinned ones' ``[layer, expert]``)."""
        return self._control.request("GET", "/v1/status?verbose=1" if verbose else "/v1/status")

    def models(self) -> list[dict[str, Any]]:
        """The registered models."""
        return self._control.request("GET", "/v1/models")["models"]

    def model(self, model: str) -> dict[str, Any]:
        """One registered model: revision, manifest path, local dir, sizes."""
        return self._control.request("GET", f"/v1/models/{model}")

    def register(self, manifest: str | Path, local_dir: str | Path | None = None, *,
                 layers: tuple[int, int] | None = None,
                 pipeline: tuple[int, int] | None = None,
                 origin: str | None = None, endpoint: str | None = None,
                 names: list[str] | None = None) -> dict[str, Any]:
        """Register a model by its manifest file (the daemon keeps its own copy).

        ``layers`` ``(start, end)`` restricts the daemon to those layers' experts (others are
        refused with ``LayerNotServed``); ``pipeline`` ``(rank, size)`` names the pipeline rank
        whose layers they are (``cachecd setup --pipeline``); ``origin`` says where the manifest
        came from (``built``, ``shipped``, the file or ``hf://`` URL given), for ``status``;
        ``endpoint`` the endpoint it was installed from (default: the daemon's own): a daemon on
        another endpoint fetches none of its experts unless told (``EndpointMismatch``);
        ``names`` the revision names (branch, tag) it was installed as: ``ORG/NAME@v2`` then
        names it, as its commit does (a name moves from another revision of the repo)."""
        body = {"manifest": str(Path(manifest).resolve()),
                "local_dir": str(local_dir) if local_dir else None,
                "layers": list(layers) if layers else None,
                "pipeline": list(pipeline) if pipeline else None,
                "origin": origin, "endpoint": endpoint, "names": names}
        return self._control.request("POST", "/v1/models", body)

    def remove(self, model: str, *, experts: bool = False) -> dict[str, Any]:
        """Unregister ``model`` (a restart does not bring it back) and delete the resident files
        setup installed for it under the daemon's models dir; with ``experts``, evict its cached
        experts too, but for those another registered model shares. Returns what was freed
        (``resident_bytes_freed``, ``expert_bytes_freed``, ...) and what was kept, and why."""
        query = "?experts=1" if experts else ""
        return self._control.request("DELETE", f"/v1/models/{model}{query}")

    def manifest_bytes(self, model: str) -> bytes:
        """The registered manifest of ``model``, as stored by the daemon."""
        data, _ = self._control.request("GET", f"/v1/models/{model}/manifest", raw=True)
        return data

    def prefetch(self, model: str, layer: int, ids: Sequence[int]) -> int:
        """Hint that these experts will be wanted soon; returns how many were queued."""
        body = {"layer": int(layer), "ids": [int(i) for i in ids]}
        return self._control.request("POST", f"/v1/models/{model}/prefetch", body)["queued"]

    def coverage(self, model: str, detail: bool = False) -> dict[str, Any]:
        """Per-layer coverage: experts and bytes cached against the total, workload coverage,
        hit/miss history; with ``detail`` also the per-expert cached bits and access counts
        (decode with ``cachecd.report.coverage.unpack_detail``)."""
        query = "?detail=1" if detail else ""
        return self._control.request("GET", f"/v1/models/{model}/coverage{query}")

    def warm(self, model: str, layer: int, ids: Sequence[int]) -> dict[str, Any]:
        """Fetch these experts into the cache if missing, without counting them as used.

        Returns ``{"requested", "fetched", "fetched_bytes"}`` once they are cached.
        """
        body = {"layer": int(layer), "ids": [int(i) for i in ids]}
        return self._control.request("POST", f"/v1/models/{model}/warm", body)

    def pin(self, model: str, layer: int, ids: Sequence[int]) -> int:
        """Fetch if needed and pin these experts: they are never evicted."""
        body = {"layer": int(layer), "ids": [int(i) for i in ids]}
        return self._control.request("POST", f"/v1/models/{model}/pin", body)["pinned"]

    def unpin(self, model: str, layer: int, ids: Sequence[int]) -> int:
        body = {"layer": int(layer), "ids": [int(i) for i in ids]}
        return self._control.request("POST", f"/v1/models/{model}/unpin", body)["unpinned"]

    def evict(self, nbytes: int = 0, model: str | None = None, layer: int | None = None,
              ids: Sequence[int] = ()) -> int:
        """Evict ``nbytes`` by policy, or the given experts; returns bytes freed."""
        return int(self.evict_report(nbytes, model, layer, ids)["freed_bytes"])

    def evict_report(self, nbytes: int = 0, model: str | None = None, layer: int | None = None,
                     ids: Sequence[int] = ()) -> dict[str, Any]:
        """``evict``'s answer: ``freed_bytes``, and ``pinned``: how many of the given experts
        are pinned, so kept."""
        body: dict[str, Any] = {"bytes": int(nbytes)}
        if model is not None:
            body.update(model=model, layer=layer, ids=[int(i) for i in ids])
        return self._control.request("POST", "/v1/evict", body)

    def recheck(self, model: str, layer: int, ids: Sequence[int]) -> dict[int, str]:
        """Ask the daemon to hash these experts' cached blobs again, because a read found their
        bytes wrong: expert -> ``"good"`` (the blob matches its digest), ``"quarantined"`` (it
        did not: moved to quarantine/, its row dropped, so the next read fetches it again) or
        ``"absent"`` (not cached). The daemon quarantines only what its own hash fails, so
        this cannot evict a good blob."""
        body = {"layer": int(layer), "ids": [int(i) for i in ids]}
        answer = self._control.request("POST", f"/v1/models/{model}/recheck", body)
        return {int(e["expert"]): str(e["verdict"]) for e in answer["experts"]}

    def digests(self, model: str, layer: int, ids: Sequence[int]) -> list[bytes | None]:
        """Each expert's xxh3-128 as the daemon verifies its blob (a manifest made from headers:
        learnt from the expert's proven bytes), None for one not learnt yet."""
        q = f"layer={int(layer)}&ids={','.join(str(int(i)) for i in ids)}"
        answer = self._control.request("GET", f"/v1/models/{model}/digests?{q}")
        return [None if d is None else bytes.fromhex(d) for d in answer["digests"]]

    # data ------------------------------------------------------------------------------------
    def expert(self, model: str, layer: int, expert: int) -> np.ndarray:
        """One expert's bytes (its tensors as they lie in the checkpoint) as a uint8 array."""
        return self.experts(model, layer, [expert])[0]

    def experts(self, model: str, layer: int, ids: Sequence[int],
                out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """The bytes of several experts of one layer, in the order asked.

        Misses are fetched, verified and cached by the daemon first. With ``out``, bytes land in
        the caller's buffers (each at least the expert's size) and views of them are returned.
        """
        ids = [int(i) for i in ids]
        if out is not None and len(out) != len(ids):
            raise InvalidRequest(f"out has {len(out)} buffers for {len(ids)} experts")
        arrays: list[np.ndarray] = []

        def targets(sizes: list[int], start: int) -> list[Target]:
            if out is None:
                got = [np.empty(n, np.uint8) for n in sizes]
            else:
                got = [_fit(buf, n) for buf, n in zip(out[start:start + len(sizes)], sizes, strict=True)]
            arrays.extend(got)
            return [memoryview(a.data) for a in got]

        self._read_experts(model, layer, ids, targets)
        return arrays

    def experts_into(self, model: str, layer: int, ids: Sequence[int],
                     targets: Sequence[Target],
                     landed: Landed | None = None, *,
                     ahead: bool = False, digests: Sequence[bytes | None] | None = None) -> list[int]:
        """Read several experts of one layer straight into the caller's memory; their sizes.

        ``targets[i]`` is a writable buffer of at least the expert's size, or a list of buffers
        that the expert's bytes fill one after another (each tensor into its own array, with no
        copy in between). Misses are fetched, verified and cached by the daemon first.
        ``landed(i, n)``, if given, is called (on this thread, in order) as soon as the
        first ``n`` bytes of expert ``ids[i]`` are in its target (``n`` ends at its size),
        while the rest are still being read (``transport.parallel_preadv``). ``ahead``: a read of
        guessed experts (read-ahead), on threads demand reads never share.

        ``digests[i]``: expert ``ids[i]``'s xxh3-128 (its manifest's; None: not checked). Each expert's bytes are
        then hashed on the reader threads as they land; one that fails is rechecked by the
        daemon (``recheck``: a rotten blob is quarantined), read again (fetched again) into the
        same target, its ``landed`` calls starting again from its first bytes (``n`` falls
        back), and checked again; a second failure raises ``ChecksumMismatch``. Once this
        returns, every target holds bytes that matched their digest.
        """
        ids = [int(i) for i in ids]
        if len(targets) != len(ids):
            raise InvalidRequest(f"{len(targets)} targets for {len(ids)} experts")
        sizes: list[int] = []

        def given(got: list[int], start: int) -> list[Target]:
            chunk = list(targets[start:start + len(got)])
            for i, (size, target) in enumerate(zip(got, chunk, strict=True)):
                room = target.nbytes if isinstance(target, memoryview) else sum(
                    v.nbytes for v in target)
                if size > room:
                    raise ExpertSizeMismatch(
                        f"the daemon has {size} bytes for expert {ids[start + i]} of layer "
                        f"{layer}; the buffers given hold {room}")
            sizes.extend(got)
            return chunk

        self._read_experts(model, layer, ids, given, landed,
                           self._ahead_pool if ahead else self._pool, digests)
        return sizes

    def _read_experts(self, model: str, layer: int, ids: list[int],
                      targets: Callable[[list[int], int], list[Target]],
                      landed: Landed | None = None,
                      pool: ThreadPoolExecutor | None = None,
                      digests: Sequence[bytes | None] | None = None) -> None:
        if digests is not None and len(digests) != len(ids):
            raise InvalidRequest(f"{len(digests)} digests for {len(ids)} experts")
        for start in range(0, len(ids), MAX_FDS_PER_FRAME):
            chunk = ids[start:start + MAX_FDS_PER_FRAME]
            want = None if digests is None else list(digests[start:start + len(chunk)])
            shifted = None if landed is None else (lambda i, n, s=start: landed(s + i, n))
            self._read_frame(model, layer, chunk, functools.partial(_at, targets, start),
                             shifted, pool, want)

    def _read_frame(self, model: str, layer: int, chunk: list[int],
                    targets: Callable[[list[int]], list[Target]], landed: Landed | None,
                    pool: ThreadPoolExecutor | None, want: list[bytes | None] | None) -> None:
        got: list[tuple[list[int], list[Target]]] = []

        def outs(sizes: list[int]) -> list[Target]:
            got.append((sizes, targets(sizes)))
            return got[0][1]

        bad = self._read_chunk(model, layer, chunk, outs, landed, pool, want)
        if bad:
            assert want is not None
            self._read_again(model, layer, chunk, bad, got[0], landed, pool, want)

    def _read_chunk(self, model: str, layer: int, chunk: list[int],
                    outs: Callable[[list[int]], list[Target]], landed: Landed | None,
                    pool: ThreadPoolExecutor | None, want: list[bytes | None] | None) -> list[int]:
        """One frame's experts read into ``outs(sizes)``; the positions whose bytes failed."""
        frame = {"op": "experts", "model": model, "layer": int(layer), "ids": chunk}
        if self.warming:
            frame["warm"] = True
        with self._waits.watch(int(layer), len(chunk)):
            answer, fds = self._data.request(frame)
        try:
            sizes = [int(e["size"]) for e in answer["experts"]]
            self.upstream_fetches += sum(1 for e in answer["experts"] if e.get("fetched"))
            if len(fds) != len(sizes) or len(sizes) != len(chunk):
                raise InvalidRequest(
                    f"daemon sent {len(fds)} descriptors and {len(sizes)} sizes for "
                    f"{len(chunk)} experts")
            return parallel_preadv(pool or self._pool, fds, sizes, outs(sizes), landed, want)
        finally:
            for fd in fds:
                os.close(fd)

    def _read_again(self, model: str, layer: int, chunk: list[int], bad: list[int],
                    first: tuple[list[int], list[Target]], landed: Landed | None,
                    pool: ThreadPoolExecutor | None, want: list[bytes | None]) -> None:
        """The experts at ``bad`` read wrong: the daemon hashes their blobs again (quarantining
        rot, so this read fetches them again), then they are read into the same targets and
        checked once more."""
        sizes, targets = first
        ids = [chunk[i] for i in bad]
        self.checksum_mismatches += len(ids)
        verdicts = self.recheck(model, layer, ids)
        log.warning("event=expert_checksum_mismatch model=%s layer=%d experts=%s verdicts=%s",
                    model, layer, ids, ",".join(verdicts[e] for e in ids))

        def outs(again: list[int]) -> list[Target]:
            if again != [sizes[i] for i in bad]:
                raise ExpertSizeMismatch(
                    f"layer {layer} experts {ids}: the daemon has {again} bytes for them now, "
                    f"{[sizes[i] for i in bad]} before")
            return [targets[i] for i in bad]

        still = self._read_chunk(model, layer, ids, outs,
                                 None if landed is None else lambda j, n: landed(bad[j], n),
                                 pool, [want[i] for i in bad])
        if still:
            raise ChecksumMismatch(
                f"layer {layer} experts {[ids[j] for j in still]} of {model}: their bytes failed "
                "their xxh3-128 as read from the cache twice, the second time after the daemon "
                f"checked the blobs ({', '.join(verdicts[ids[j]] for j in still)}): the disk or "
                "memory may be failing; run `cachecd fsck`, check the disk, then try again")

    def on_wait(self, progress: Callable[[WaitProgress], None] | None) -> None:
        """While a read waits on the daemon's fetches (a cold layer's misses), call ``progress``
        about every second from a watcher thread with its figures (``WaitProgress``: fetched of
        those under way, bytes, rate, time left); None: stop."""
        self._waits.progress = progress

    def close(self) -> None:
        self._waits.close()
        self._control.close()
        self._data.close()
        self._pool.shutdown(wait=False)
        self._ahead_pool.shutdown(wait=False)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _at(targets: Callable[[list[int], int], list[Target]], start: int,
        sizes: list[int]) -> list[Target]:
    return targets(sizes, start)


def _fit(buf: np.ndarray, n: int) -> np.ndarray:
    if buf.dtype != np.uint8 or buf.size < n or not buf.flags.c_contiguous:
        raise InvalidRequest(f"an out buffer must be a contiguous uint8 array of at least {n} bytes")
    return buf[:n]


class AsyncClient:
    """The same API for asyncio code: each call runs the synchronous client in a thread."""

    def __init__(self, socket: str | Path | None = None, **kwargs: Any) -> None:
        self._sync = Client(socket, **kwargs)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._sync, name)
        if not callable(method) or name.startswith("_"):
            return method

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.to_thread(method, *args, **kwargs)

        return call

    async def aclose(self) -> None:
        self._sync.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
