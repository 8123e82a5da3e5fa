"""Expert bytes -> mx arrays: each format's decoder against arrays mlx produced itself."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import xxhash

from cachecd import errors
from cachecd.manifest.entries import ByteRange, ExpertEntry, TensorInfo
from cachecd_engine.formats import Arrays, QuantSpec, quant_spec, stack_from_blobs

PREFIX = "language_model.model.layers.3.block_sparse_moe.experts.7."
SHAPES = {"w1": (64, 96), "w2": (96, 64), "w3": (64, 96)}  # [out, in]
PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def make_entry(tensors: list[tuple[str, str, tuple[int, ...], bytes]]) -> tuple[bytes, ExpertEntry]:
    """An expert whose bytes are ``tensors`` in the given order, as the manifest describes it."""
    infos, offsets, pos = [], [], 0
    for name, dtype, shape, data in tensors:
        infos.append(
            TensorInfo(
                PREFIX + name,
                dtype,
                shape,
                "m.safetensors",
                1000 + pos,
                len(data),
                xxhash.xxh3_128(data).digest(),
            )
        )
        offsets.append(pos)
        pos += len(data)
    blob = b"".join(t[3] for t in tensors)
    entry = ExpertEntry(
        3,
        7,
        pos,
        xxhash.xxh3_128(blob).digest(),
        (ByteRange("m.safetensors", 1000, 1000 + pos),),
        tuple(infos),
        tuple(offsets),
    )
    return blob, entry


def mxfp4_expert(seed: int) -> tuple[dict[str, tuple[mx.array, mx.array]], list]:
    mx.random.seed(seed)
    quantized, tensors = {}, []
    for w, shape in SHAPES.items():
        q, s = mx.quantize(mx.random.normal(shape), group_size=32, bits=4, mode="mxfp4")
        quantized[w] = (q, s)
        tensors.append(
            (
                f"{w}.weight_packed",
                "U8",
                (shape[0], shape[1] // 2),
                np.array(q).view(np.uint8).tobytes(),
            )
        )
        tensors.append((f"{w}.weight_scale", "U8", tuple(s.shape), np.array(s).tobytes()))
    return quantized, tensors


def decode_expert(spec: QuantSpec, entry: object, blob: object) -> Arrays:
    """One expert's arrays: its row of a one-expert stack."""
    stack = stack_from_blobs(spec, [entry], [blob])  # type: ignore[list-item]
    return {p: {k: v[0] for k, v in arrays.items()} for p, arrays in stack.items()}


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("order", ["sorted", "reversed"])
def test_mxfp4_decodes_to_mlx_quantized_rows(order: str) -> None:
    quantized, tensors = mxfp4_expert(0)
    tensors = sorted(tensors, reverse=order == "reversed")  # the layout comes from the entry
    blob, entry = make_entry(tensors)
    dec = decode_expert(quant_spec("mxfp4-pack-quantized"), entry, blob)
    for w, (q, s) in quantized.items():
        arrays = dec[PROJ[w]]
        assert set(arrays) == {"weight", "scales"}
        assert _equal(arrays["weight"], q) and _equal(arrays["scales"], s)


def test_numpy_and_memoryview_buffers_decode_the_same() -> None:
    _, tensors = mxfp4_expert(1)
    blob, entry = make_entry(sorted(tensors))
    spec = quant_spec("mxfp4-pack-quantized")
    a = decode_expert(spec, entry, np.frombuffer(blob, np.uint8))
    b = decode_expert(spec, entry, memoryview(bytearray(blob)))
    for proj in a:
        for name in a[proj]:
            assert _equal(a[proj][name], b[proj][name])


@pytest.mark.parametrize(("dtype", "mx_dtype"), [("F32", mx.float32), ("BF16", mx.bfloat16)])
def test_plain_weights(dtype: str, mx_dtype: mx.Dtype) -> None:
    mx.random.seed(2)
    want = {w: mx.random.normal(shape).astype(mx_dtype) for w, shape in SHAPES.items()}
    tensors = [
        (f"{w}.weight", dtype, shape, bytes(memoryview(want[w])))
        for w, shape in sorted(SHAPES.items())
    ]
    blob, entry = make_entry(tensors)
    dec = decode_expert(quant_spec("none"), entry, blob)
    for w, arr in want.items():
        assert _equal(dec[PROJ[w]]["weight"], arr)


def test_int4_symmetric_matches_compressed_tensors_meaning() -> None:
    """pack-quantized: 8 nibbles per int32, value = (nibble - 8) * scale, scales bf16 per 32."""
    rng = np.random.default_rng(3)
    tensors, want = [], {}
    for w, (out, inp) in sorted(SHAPES.items()):
        nibbles = rng.integers(0, 16, size=(out, inp), dtype=np.uint32)
        packed = np.zeros((out, inp // 8), np.uint32)
        for k in range(8):
            packed |= nibbles[:, k::8] << (4 * k)
        scales = mx.array(rng.uniform(0.01, 0.1, size=(out, inp // 32)).astype(np.float32))
        scales = scales.astype(mx.bfloat16)
        s32 = mx.repeat(scales.astype(mx.float32), 32, axis=1)
        want[w] = mx.array(nibbles.astype(np.float32) - 8) * s32  # exact in fp32
        tensors.append((f"{w}.weight_packed", "I32", packed.shape, packed.view(np.int32).tobytes()))
        tensors.append(
            (f"{w}.weight_scale", "BF16", tuple(scales.shape), bytes(memoryview(scales)))
        )
    blob, entry = make_entry(tensors)
    dec = decode_expert(quant_spec("pack-quantized"), entry, blob)
    for w, expected in want.items():
        a = dec[PROJ[w]]
        assert a["scales"].dtype == a["biases"].dtype == mx.bfloat16
        f32 = [a["scales"].astype(mx.float32), a["biases"].astype(mx.float32)]
        got = mx.dequantize(a["weight"], *f32, group_size=32, bits=4)
        assert bool(mx.array_equal(got, expected).item())


def test_stack_keeps_the_given_order() -> None:
    spec = quant_spec("mxfp4-pack-quantized")
    made, raw = [], []
    for seed in (10, 11, 12):
        quantized, tensors = mxfp4_expert(seed)
        made.append(make_entry(sorted(tensors)))
        raw.append(quantized)
    (blob2, entry2), (blob0, entry0) = made[2], made[0]
    stacks = stack_from_blobs(spec, [entry2, entry0], [blob2, blob0])
    want = mx.stack([raw[2]["w2"][0], raw[0]["w2"][0]])
    assert _equal(stacks["down_proj"]["weight"], want)
    assert stacks["gate_proj"]["scales"].shape == (2, 64, 3)


def test_wrong_length_is_refused() -> None:
    _, tensors = mxfp4_expert(4)
    blob, entry = make_entry(sorted(tensors))
    with pytest.raises(errors.ExpertSizeMismatch, match="manifest entry"):
        decode_expert(quant_spec("mxfp4-pack-quantized"), entry, blob + b"\0")


def test_unknown_tensor_or_missing_projection_is_refused() -> None:
    spec = quant_spec("mxfp4-pack-quantized")
    _, tensors = mxfp4_expert(5)
    blob, entry = make_entry([("w4.weight_packed", "U8", (4, 4), b"\0" * 16)])
    with pytest.raises(errors.UnsupportedFormat, match="w4"):
        decode_expert(spec, entry, blob)
    blob, entry = make_entry([t for t in sorted(tensors) if not t[0].startswith("w3")])
    with pytest.raises(errors.UnsupportedFormat, match="up_proj"):
        decode_expert(spec, entry, blob)


def test_unknown_format_is_refused() -> None:
    with pytest.raises(errors.UnsupportedFormat, match="mxfp8"):
        quant_spec("mxfp8")


def fp8_reference(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """What a block-fp8 weight means, decoded in numpy: e4m3fn codes (bias 7, subnormals below
    exponent 1) times their 128x128 block's scale in fp32, rounded to bf16 (ties to even)."""
    sign = np.where(codes >> 7, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    normal = (1 + man / 8) * 2.0 ** (exp.astype(int) - 7)
    value = sign * np.where(exp == 0, man / 8 * 2.0**-6, normal)
    block = np.repeat(np.repeat(scales.astype(np.float32), 128, 0), 128, 1)
    prod = value.astype(np.float32) * block[: codes.shape[0], : codes.shape[1]]
    bits = prod.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


@pytest.mark.parametrize("scale_dtype", ["F32", "BF16"])
def test_fp8_block_decodes_to_bf16_as_its_meaning(scale_dtype: str) -> None:
    """F8_E4M3 weights (kept as bytes) and 128x128 block scales, whole and partial blocks."""
    rng = np.random.default_rng(7)
    shapes = {"w1": (192, 136), "w2": (136, 192), "w3": (192, 136)}
    tensors, want = [], {}
    for w, (out, inp) in sorted(shapes.items()):
        codes = rng.integers(0, 256, size=(out, inp), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x38  # e4m3fn's NaN codes -> 1.0
        scales = mx.array(rng.uniform(0.01, 0.1, size=(2, 2)).astype(np.float32))
        if scale_dtype == "BF16":
            scales = scales.astype(mx.bfloat16)
        want[w] = fp8_reference(codes, np.array(scales.astype(mx.float32)))
        tensors.append((f"{w}.weight", "F8_E4M3", (out, inp), codes.tobytes()))
        tensors.append((f"{w}.weight_scale_inv", scale_dtype, (2, 2), bytes(memoryview(scales))))
    blob, entry = make_entry(tensors)
    dec = decode_expert(quant_spec("fp8"), entry, blob)
    for w, expected in want.items():
        got = dec[PROJ[w]]["weight"]
        assert got.dtype == mx.bfloat16 and got.shape == shapes[w]
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), expected)
