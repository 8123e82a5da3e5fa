"""The compute of a decode token, measured: one MoE layer of the manifest's expert shape and
quant format, as mlx-lm's ``SwitchGLU`` (the template the engine's bank calls) over ``top_k``
experts, timed on this machine's default device, times the model's MoE layers.

It measures the routed experts' compute alone: the plan's compute where the model's config.json
is not known (a manifest file), and the prompt's prefill probe. Where the config is known the
plan times the whole token instead (``token_probe``: attention, dense layers, shared experts
and the head too).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cachecd.manifest.manifest import Manifest


def expert_dims(manifest: Manifest) -> tuple[int, int]:
    """(hidden, intermediate) of an expert: the rows of its down and gate projections."""
    from cachecd_engine.formats import StackLayout

    layer = manifest.moe_layers[0]
    slots = StackLayout.of(manifest.expert(layer, 0)).slots
    rows = {s.key[0]: s.shape[0] for s in slots if s.key[1] in ("weight_packed", "weight")}
    return rows["down_proj"], rows["gate_proj"]


def moe_layer_s(manifest: Manifest, top_k: int, dtype: str = "float32", reps: int = 5,
                rows: int = 1) -> float:
    """Median seconds of one MoE layer's call for ``rows`` tokens (one: a decode token; a
    prefill step's rows: ``prompt``), after two warm-up calls."""
    import mlx.core as mx

    glu = _template(manifest, top_k, dtype)
    dt = getattr(mx, dtype)
    x = mx.random.normal((1, rows, expert_dims(manifest)[0])).astype(dt)
    idx = mx.broadcast_to(mx.arange(top_k, dtype=mx.uint32), (1, rows, top_k))
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        mx.eval(glu(x, idx))
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _template(manifest: Manifest, top_k: int, dtype: str) -> Any:
    """mlx-lm's SwitchGLU with ``top_k`` experts of the manifest's shape and format. Each
    projection is made (and quantized) once and repeated: mlx-lm's own constructor makes every
    expert in fp32 first (GBs at K3's size), and equal experts compute as fast as others."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    from cachecd_engine.formats import quant_spec

    hidden, inter = expert_dims(manifest)
    spec = quant_spec(manifest.quant_format)
    dt = getattr(mx, dtype)
    glu = SwitchGLU(32, 32, top_k)  # small; its parameters are replaced below
    if spec.mode is not None:
        nn.quantize(glu, group_size=spec.group_size, bits=spec.bits, mode=spec.mode)
    for name, (out, inp) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                             ("down_proj", (hidden, inter))):
        w = (mx.random.normal((out, inp)) * inp ** -0.5).astype(dt)
        if spec.mode is None:
            params = {"weight": w}
        else:
            q = mx.quantize(w, spec.group_size, spec.bits, mode=spec.mode)
            params = dict(zip(("weight", "scales", "biases"), q, strict=False))
            params = {k: v.astype(dt) if k == "biases" else v for k, v in params.items()}
        getattr(glu, name).update({k: mx.repeat(v[None], top_k, axis=0)
                                   for k, v in params.items()})
    glu.set_dtype(dt)
    mx.eval(glu.parameters())
    return glu


@dataclass
class EngineCosts:
    """A streamed MoE layer call's costs beyond its compute, measured with the engine's own
    layer (``StreamedSwitchGLU`` over an ``ExpertBank``): the host work and read-back of every
    call (``call_s``), and what a call whose experts all miss adds to it (``miss_s``: the read of
    its ``miss_bytes``, from the page cache, and the bank's host work for it). Where a daemon
    serves the model, the misses are read through it with the engine's own source, so
    ``miss_s`` holds the daemon's round trip as a decode incurs it (right after the previous
    call's compute: 0.32-0.63 ms on a 2-vCPU machine after MLX work, where requests back to
    back take 0.13-0.32); ``request_experts`` is then the experts asked in it. Else they come from a
    local file, and ``request_experts`` is 0: the plan adds the doctor's round trip.
    ``cold_miss_s``: the same call with its experts' blobs dropped from the page cache first
    (where the daemon's blobs are in a cache dir the doctor measured), so they come off the
    disk as a cold decode's do, each read blocking the call in turn."""

    compute_s: float  # one layer's compute (mlx-lm's SwitchGLU, resident)
    call_s: float
    miss_s: float
    miss_bytes: int = 0
    request_experts: int = 0
    cold_miss_s: float | None = None

    def miss_call_s(self, page_rate: float) -> float:
        """What a call with misses adds beyond its bytes at the page cache's rate (a token's
        time counts the bytes apart, at the rate of wherever they come from)."""
        return max(0.0, self.miss_s - self.miss_bytes / page_rate) if page_rate else self.miss_s

    def cold_rate(self, page_rate: float) -> float | None:
        """The rate a call's misses come off the disk at, as the engine reads them: their bytes
        over their time at the page cache's rate plus what the cold call took more."""
        if self.cold_miss_s is None or not page_rate or not self.miss_bytes:
            return None
        more = max(0.0, self.cold_miss_s - self.miss_s)
        return self.miss_bytes / (self.miss_bytes / page_rate + more)


def engine_costs(manifest: Manifest, top_k: int, dtype: str = "float32", reps: int = 5,
                 tmp_dir: str | None = None, socket: str | None = None,
                 cache_dirs: list[str] | None = None) -> EngineCosts:
    """The costs, with the misses read through the daemon on ``socket`` where it serves
    ``manifest``'s model with enough of its experts cached, else from a local file; cold too
    where those experts' blobs are in ``cache_dirs``. A call's
    own cost is always measured on the local file's experts (weights whose sums stay normal
    numbers, as the compute probe's do); a miss's is the difference of two calls on the same
    experts, so their weights cancel out."""
    import tempfile

    compute = moe_layer_s(manifest, top_k, dtype, reps)
    with tempfile.TemporaryDirectory(prefix="cachecd-probe-", dir=tmp_dir) as d:
        path = os.path.join(d, "expert")
        with open(path, "wb") as f:
            f.write(_expert_bytes(manifest))
        with _FileSource(manifest, path) as source:
            hit, miss, _ = _streamed_calls(manifest, source, top_k, dtype, reps)
    asked, cold = 0, None
    daemon = _daemon_source(manifest, top_k, socket)
    if daemon is not None:
        source, sets = daemon
        drop = _dropper(source.manifest, sets, cache_dirs or [])
        try:
            hit_d, miss_d, cold_d = _streamed_calls(manifest, source, top_k, dtype, reps, sets,
                                                    drop)
        finally:
            source.close()
        miss, hit_miss, asked = miss_d, hit_d, top_k
        cold = None if cold_d is None else max(0.0, cold_d - hit_d)
    else:
        hit_miss = hit
    nbytes = top_k * manifest.expert(manifest.moe_layers[0], 0).nbytes
    return EngineCosts(compute, max(0.0, hit - compute), max(0.0, miss - hit_miss), nbytes, asked,
                       cold)


def _dropper(served: Manifest, sets: list[list[int]],
             cache_dirs: list[str]) -> Callable[[list[int]], None] | None:
    """A function that drops these experts' blobs from the page cache (the daemon passes their
    fds and keeps them clean: dropping them costs nothing but their next read), or None where
    one is not found in ``cache_dirs`` or the OS cannot drop a file's pages."""
    if not hasattr(os, "posix_fadvise"):
        return None
    layer = served.moe_layers[0]
    paths: dict[int, str] = {}
    for e in (e for ids in sets for e in ids):
        d = served.expert(layer, e).digest_hex
        found = [p for c in cache_dirs if os.path.isfile(p := os.path.join(c, "blobs", d[:2], d))]
        if not found:
            return None
        paths[e] = found[0]

    def drop(ids: list[int]) -> None:
        for e in ids:
            fd = os.open(paths[e], os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    return drop


SETS = 4  # calls' worth of distinct experts the daemon probe cycles through


def _daemon_source(manifest: Manifest, top_k: int,
                   socket: str | None) -> tuple[Any, list[list[int]]] | None:
    """The engine's daemon source for ``manifest``'s model and sets of ``top_k`` of its cached
    experts of one layer (two at least, ``SETS`` at most), each a call's misses; None where no
    daemon answers on ``socket``, it does not serve this revision, or too few are cached. Its
    reads are marked as warming: they count no use, hit or miss."""
    if socket is None:
        return None
    from cachecd.errors import CachecdError
    from cachecd.report.coverage import unpack_detail
    from cachecd_client import Client
    from cachecd_engine.daemon_source import DaemonSource

    try:
        client = Client(socket, timeout=10)
    except (CachecdError, OSError):
        return None
    try:
        client.warming = True
        served = Manifest.from_bytes(client.manifest_bytes(manifest.repo), "daemon")
        if served.revision == manifest.revision:
            cached, _ = unpack_detail(client.coverage(manifest.repo, detail=True)["detail"])
            layer = manifest.moe_layers[0]
            ids = served.expert_ids[cached & (served.layer_ids == layer)].tolist()
            sets = [ids[i:i + top_k] for i in range(0, min(len(ids), SETS * top_k), top_k)]
            sets = [s for s in sets if len(s) == top_k]
            if len(sets) >= 2:
                return DaemonSource(client, manifest.repo, served), sets
    except (CachecdError, OSError, KeyError, ValueError):
        pass
    client.close()
    return None


# One of each tensor's elements: scales of 1 and small weights, so the probe's sums stay normal
# numbers (subnormals are many times slower on a CPU).
_ONE = {"U8": b"\x7f", "BF16": b"\x80\x3f", "F16": b"\x00\x3c", "F32": b"\x00\x00\x80\x3f"}
_SMALL = {"U8": b"\x11", "I8": b"\x01", "I32": b"\x11" * 4, "U32": b"\x11" * 4,
          "F8_E4M3": b"\x30", "BF16": b"\x00\x3c", "F16": b"\x00\x20",
          "F32": b"\x00\x00\x80\x3c"}


def _expert_bytes(manifest: Manifest) -> bytes:
    entry = manifest.expert(manifest.moe_layers[0], 0)
    out = bytearray(entry.nbytes)
    for t, offset in zip(entry.tensors, entry.blob_offsets, strict=False):
        table = _ONE if "scale" in t.name else _SMALL
        unit = table.get(t.dtype, b"\x00")
        out[offset:offset + t.nbytes] = (unit * (t.nbytes // len(unit) + 1))[:t.nbytes]
    return bytes(out)


class _FileSource:
    """Every expert's bytes from one local file (the engine's ``ExpertSource``)."""

    def __init__(self, manifest: Manifest, path: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.manifest = manifest
        self.fd = os.open(path, os.O_RDONLY)
        self.pool = ThreadPoolExecutor(4)  # the client's readers

    def __enter__(self) -> _FileSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown()
        os.close(self.fd)

    def entry(self, layer: int, expert: int) -> Any:
        return self.manifest.expert(layer, expert)

    def read_into(self, layer: int, ids: list[int], targets: Any, done: Any = None) -> int:
        from cachecd_client.transport import parallel_preadv

        sizes = [self.manifest.expert(layer, e).nbytes for e in ids]
        parallel_preadv(self.pool, [self.fd] * len(ids), sizes, targets, done)
        return sum(sizes)

    def prefetch(self, layer: int, ids: list[int]) -> None:
        pass


def _streamed_calls(manifest: Manifest, source: Any, top_k: int, dtype: str, reps: int,
                    sets: list[list[int]] | None = None,
                    drop: Callable[[list[int]], None] | None = None,
                    ) -> tuple[float, float, float | None]:
    """Median seconds of a streamed layer call whose experts all hit, of one whose experts
    all miss (a pool of ``top_k`` slots, ``sets`` of experts in turn (default: two), each read
    once before the clock starts), and with ``drop``, of one whose experts ``drop`` took out of
    the page cache just before (untimed)."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchGLU

    from cachecd_engine.formats import quant_spec
    from cachecd_engine.pool.bank import ExpertBank
    from cachecd_engine.streamed_moe import StreamedSwitchGLU, as_template

    spec = quant_spec(manifest.quant_format)
    hidden, inter = expert_dims(manifest)
    e, layer = manifest.experts_per_layer, manifest.moe_layers[0]
    if sets is None:
        sets = [list(range(top_k)), list(range(top_k, 2 * top_k))] if 2 * top_k <= e else []
    dt = getattr(mx, dtype)
    from cachecd.plan.simulate import slot_bytes

    bank = ExpertBank(source, spec, top_k * slot_bytes(manifest), experts_per_layer=2 * top_k)
    try:
        template = as_template(SwitchGLU(hidden, inter, 2 * top_k), spec)
        template.set_dtype(dt)
        streamed = StreamedSwitchGLU(layer, template, bank)
        x = mx.random.normal((1, 1, hidden)).astype(dt)

        def call(ids: list[int]) -> float:
            idx = mx.array(ids, dtype=mx.uint32).reshape(1, 1, len(ids))
            t0 = time.perf_counter()
            mx.eval(streamed(x, idx))
            return time.perf_counter() - t0

        first = sets[0] if sets else list(range(top_k))
        hit = statistics.median([call(first) for _ in range(reps + 2)][2:])
        if not sets:
            return hit, hit, None
        for ids in sets[1:] + sets[:1]:  # each set read once, untimed (off the disk)
            call(ids)
        miss = statistics.median([call(sets[(i + 1) % len(sets)]) for i in range(reps)])
        if drop is None:
            return hit, miss, None
        cold = []
        for i in range(reps):
            ids = sets[(reps + i + 1) % len(sets)]
            drop(ids)
            cold.append(call(ids))
        return hit, miss, statistics.median(cold)
    finally:
        bank.close()
