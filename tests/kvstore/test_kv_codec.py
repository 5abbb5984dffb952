"""Compressed KV: per-channel scales, round-trip error bounds per encoding, zero and extreme
values, and QuantizedPair moving and dequantizing."""

from __future__ import annotations

import pytest
import torch

from kvstore import codec
from kvstore.codec import QuantizedPair
from tests.kvstore.kv_testutil import make_kv

COMPRESSED = ["fp8_e4m3", "int8"]
# Relative error (‖x - x̂‖ / ‖x‖) bound of Gaussian KV: fp8 keeps 3 mantissa bits (≤ 6.25% per
# value), int8 a 1/254 step of each channel's range.
REL_ERROR = {"fp8_e4m3": 0.04, "int8": 0.01}


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    # float64: the norms of values near float32's range would overflow or underflow in it.
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def test_encodings_are_named_and_an_unknown_one_is_a_value_error_naming_the_choices() -> None:
    assert codec.ENCODINGS == ("none", "fp8_e4m3", "int8")
    assert codec.check_encoding("int8") == "int8"
    with pytest.raises(ValueError, match="none, fp8_e4m3, int8"):
        codec.check_encoding("int4")
    with pytest.raises(ValueError, match="nothing to quantize"):
        codec.quantize(torch.ones(2, 3, 4), "none")


@pytest.mark.parametrize("encoding", COMPRESSED)
def test_round_trip_error_is_small_for_each_dtype(encoding: str, dtype: torch.dtype) -> None:
    kv = make_kv(seed=5, dtype=dtype, num_tokens=64, head_dim=32)
    back = codec.round_trip(kv, encoding)
    assert back.keys.dtype == dtype and back.keys.shape == kv.keys.shape
    assert _relative_error(back.keys, kv.keys) < REL_ERROR[encoding]
    assert _relative_error(back.values, kv.values) < REL_ERROR[encoding]


def test_encoding_none_round_trip_is_the_entry_itself() -> None:
    kv = make_kv(seed=2)
    assert codec.round_trip(kv, "none") is kv


@pytest.mark.parametrize("encoding", COMPRESSED)
def test_every_value_is_within_its_channels_quantization_step(encoding: str) -> None:
    x = torch.randn(4, 50, 16, generator=torch.Generator().manual_seed(1)) * 3
    q, scale = codec.quantize(x, encoding)
    assert q.dtype == codec.storage_dtype(encoding, torch.float32) and q.element_size() == 1
    assert scale.shape == (4, 1, 16) and scale.dtype == torch.float32
    assert torch.allclose(scale, x.abs().amax(dim=1, keepdim=True) / codec.QMAX[encoding])
    error = (codec.dequantize(q, scale, torch.float32) - x).abs()
    # int8 rounds to the nearest step; fp8 to half an ulp of 3 mantissa bits, or a subnormal step.
    bound = scale / 2 if encoding == "int8" else x.abs() / 16 + scale / 512
    assert bool((error <= bound * (1 + 1e-5)).all())


@pytest.mark.parametrize("encoding", COMPRESSED)
def test_a_large_channel_does_not_cost_other_channels_precision(encoding: str) -> None:
    x = torch.randn(2, 40, 8, generator=torch.Generator().manual_seed(3))
    x[:, :, 0] *= 1000  # an outlier channel, as keys have
    back = codec.dequantize(*codec.quantize(x, encoding), torch.float32)
    assert _relative_error(back[:, :, 1:], x[:, :, 1:]) < REL_ERROR[encoding]
    assert _relative_error(back[:, :, :1], x[:, :, :1]) < REL_ERROR[encoding]


@pytest.mark.parametrize("encoding", COMPRESSED)
def test_zero_channels_get_finite_scales_and_come_back_zero(encoding: str) -> None:
    x = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(4))
    x[0] = 0.0
    x[1, :, 2] = 0.0
    q, scale = codec.quantize(x, encoding)
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    back = codec.dequantize(q, scale, torch.float32)
    assert bool(torch.isfinite(back).all())
    assert bool((back[0] == 0).all()) and bool((back[1, :, 2] == 0).all())


@pytest.mark.parametrize("encoding", COMPRESSED)
@pytest.mark.parametrize(
    ("magnitude", "dtype"),
    [
        (3e38, torch.float32),
        (60000.0, torch.float16),
        (3e38, torch.bfloat16),
        (1e-40, torch.float32),
    ],
    ids=["fp32-max", "fp16-max", "bf16-max", "fp32-subnormal"],
)
def test_extreme_magnitudes_keep_finite_scales_and_relative_precision(
    encoding: str, magnitude: float, dtype: torch.dtype
) -> None:
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(6)).clamp(-1, 1) * magnitude
    x = x.to(dtype)
    q, scale = codec.quantize(x, encoding)
    back = codec.dequantize(q, scale, dtype)
    assert bool(torch.isfinite(scale).all()) and bool(torch.isfinite(back).all())
    if magnitude < 1e-30:
        # Scales stop at float32's smallest normal: subnormal KV (far below any real model's)
        # comes back within that, as a few bits or zero, never as inf or NaN.
        tiny = torch.finfo(torch.float32).tiny
        assert float((back.double() - x.double()).abs().max()) <= tiny
    else:
        assert _relative_error(back, x) < REL_ERROR[encoding]


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_values_cannot_be_quantized(bad: float) -> None:
    x = torch.ones(1, 3, 2)
    x[0, 1, 1] = bad
    with pytest.raises(ValueError, match="inf or NaN"):
        codec.quantize(x, "int8")


@pytest.mark.parametrize("encoding", COMPRESSED)
def test_quantized_pair_moves_compressed_and_dequantizes_to_the_original_dtype(
    encoding: str,
) -> None:
    kv = make_kv(seed=8, dtype=torch.bfloat16, num_tokens=10, head_dim=16)
    k, v = kv.layer(1)
    pair = codec.quantize_pair(k, v, encoding)
    heads, tokens, dim = k.shape
    assert pair.nbytes == 2 * heads * tokens * dim + 2 * heads * dim * 4
    moved = pair.to("cpu", non_blocking=True)
    assert isinstance(moved, QuantizedPair) and moved.k.dtype == pair.k.dtype
    dk, dv = moved.dequantize()
    assert dk.dtype == dv.dtype == torch.bfloat16 and dk.device == k.device
    assert _relative_error(dk, k) < REL_ERROR[encoding]
    assert _relative_error(dv, v) < REL_ERROR[encoding]
    whole = codec.round_trip(kv, encoding)  # per layer and per entry quantize alike
    assert torch.equal(whole.keys[1], dk) and torch.equal(whole.values[1], dv)
