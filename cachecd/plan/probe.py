"""The compute of a decode token, measured: one MoE layer of the manifest's expert shape and
quant format, as mlx-lm's ``SwitchGLU`` (the template the engine's bank calls) over ``top_k``
experts, timed on this machine's default device, times the model's MoE layers.

It measures the routed experts' compute, which is most of a decode token for a model whose
experts are big (K3's: 17.5 MB each, 16 a layer). Attention, shared experts and dense layers
are left out: for a model where they matter, give the token's compute (``--compute-ms``).
"""

from __future__ import annotations

import os
import statistics
import time
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


def moe_layer_s(manifest: Manifest, top_k: int, dtype: str = "float32", reps: int = 5) -> float:
    """Median seconds of one MoE layer's call for one token, after two warm-up calls."""
    import mlx.core as mx

    glu = _template(manifest, top_k, dtype)
    dt = getattr(mx, dtype)
    x = mx.random.normal((1, 1, expert_dims(manifest)[0])).astype(dt)
    idx = mx.arange(top_k, dtype=mx.uint32).reshape(1, 1, top_k)
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
    layer (``StreamedSwitchGLU`` over an ``ExpertBank``) reading from a local file: the host
    work and read-back of every call (``call_s``), and a call's extra host work when its
    experts are read (``miss_call_s``, beyond the read itself)."""

    compute_s: float  # one layer's compute (mlx-lm's SwitchGLU, resident)
    call_s: float
    miss_call_s: float


def engine_costs(manifest: Manifest, top_k: int, dtype: str = "float32", reps: int = 5,
                 tmp_dir: str | None = None) -> EngineCosts:
    import tempfile

    compute = moe_layer_s(manifest, top_k, dtype, reps)
    with tempfile.TemporaryDirectory(prefix="cachecd-probe-", dir=tmp_dir) as d:
        path = os.path.join(d, "expert")
        with open(path, "wb") as f:
            f.write(_expert_bytes(manifest))
        with _FileSource(manifest, path) as source:
            hit, miss, raw = _streamed_calls(manifest, source, top_k, dtype, reps)
    return EngineCosts(compute, max(0.0, hit - compute), max(0.0, miss - hit - raw))


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


def _streamed_calls(manifest: Manifest, source: _FileSource, top_k: int, dtype: str,
                    reps: int) -> tuple[float, float, float]:
    """Median seconds of a streamed layer call whose experts all hit, of one whose experts all
    miss (a pool of ``top_k`` slots, two sets of experts in turn), and of the raw read of
    ``top_k`` experts' bytes."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchGLU

    from cachecd_engine.bank import ExpertBank
    from cachecd_engine.formats import quant_spec
    from cachecd_engine.streamed_moe import StreamedSwitchGLU, as_template

    spec = quant_spec(manifest.quant_format)
    hidden, inter = expert_dims(manifest)
    e, layer = manifest.experts_per_layer, manifest.moe_layers[0]
    dt = getattr(mx, dtype)
    from cachecd.plan.simulate import slot_bytes

    bank = ExpertBank(source, spec, top_k * slot_bytes(manifest), experts_per_layer=2 * top_k)
    try:
        template = as_template(SwitchGLU(hidden, inter, 2 * top_k), spec)
        template.set_dtype(dt)
        streamed = StreamedSwitchGLU(layer, template, bank)
        x = mx.random.normal((1, 1, hidden)).astype(dt)
        sets = [list(range(top_k)), list(range(top_k, 2 * top_k))] if 2 * top_k <= e else None

        def call(ids: list[int]) -> float:
            idx = mx.array(ids, dtype=mx.uint32).reshape(1, 1, len(ids))
            t0 = time.perf_counter()
            mx.eval(streamed(x, idx))
            return time.perf_counter() - t0

        hit = statistics.median([call(sets[0] if sets else list(range(top_k)))
                                 for _ in range(reps + 2)][2:])
        miss = hit if sets is None else statistics.median(
            [call(sets[i % 2]) for i in range(reps + 2)][2:])
        raw = statistics.median([_raw_read(source, layer, top_k) for _ in range(reps)])
        return hit, miss, raw
    finally:
        bank.close()


def _raw_read(source: _FileSource, layer: int, n: int) -> float:
    import mmap

    size = source.manifest.expert(layer, 0).nbytes
    bufs = [mmap.mmap(-1, size) for _ in range(n)]
    for b in bufs:
        b.write(bytes(size))
    t0 = time.perf_counter()
    source.read_into(layer, list(range(n)), [memoryview(b) for b in bufs])
    dt = time.perf_counter() - t0
    for b in bufs:
        b.close()
    return dt
