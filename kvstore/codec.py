"""Compressed KV: one byte per value (fp8 e4m3 or int8) with a float32 scale per head and channel,
quantized on the host before an SSD write and dequantized on the device after the copy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvstore.types import ChunkKV

Encoding = Literal["none", "fp8_e4m3", "int8"]
ENCODINGS: tuple[Encoding, ...] = ("none", "fp8_e4m3", "int8")

# Storage dtype and largest magnitude of each compressed encoding. A channel's amax maps to qmax.
_STORAGE: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
QMAX: dict[str, float] = {"fp8_e4m3": 448.0, "int8": 127.0}
SCALE_DTYPE = torch.float32
_TINY = torch.finfo(torch.float32).tiny


def check_encoding(encoding: str) -> Encoding:
    """`encoding` if it is one of ENCODINGS, else a ValueError naming the choices."""
    for known in ENCODINGS:
        if encoding == known:
            return known
    raise ValueError(f"unknown KV encoding {encoding!r}; choose one of {', '.join(ENCODINGS)}")


def storage_dtype(encoding: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a value of `dtype` is stored as under `encoding`."""
    return dtype if encoding == "none" else _STORAGE[check_encoding(encoding)]


def quantize(x: torch.Tensor, encoding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` ([..., n, D]) in a compressed encoding and its scales ([..., 1, D] float32): one scale
    per channel over the n tokens, amax / qmax, so every value fits; an all-zero channel gets
    scale 1 (no NaN or inf). Raises ValueError for non-finite input: no scale could hold it."""
    if check_encoding(encoding) == "none":
        raise ValueError("encoding 'none' stores values as they are; nothing to quantize")
    qmax = QMAX[encoding]
    x32 = x.detach().to(torch.float32)
    amax = x32.abs().amax(dim=-2, keepdim=True)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("cannot quantize KV with inf or NaN values")
    # clamp_min: a channel of subnormals must not get a scale that underflows to zero.
    scale = torch.where(amax > 0, (amax / qmax).clamp_min(_TINY), torch.ones_like(amax))
    scaled = (x32 / scale).clamp_(-qmax, qmax)  # rounding may overshoot qmax by an ulp
    if encoding == "int8":
        scaled = scaled.round_()
    return scaled.to(_STORAGE[encoding]), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of `dtype` from a compressed tensor and its scales, on their own device."""
    # In place on the float32 copy: one temporary instead of two (it is the CPU path's cost).
    return q.to(torch.float32).mul_(scale).to(dtype)


@dataclass(frozen=True)
class QuantizedPair:
    """One layer's K and V of one chunk as stored: payloads [H_kv, n, D] in the storage dtype,
    scales [H_kv, 1, D] float32, and `dtype`, the dtype the values had before quantizing."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes moved when this pair is copied: payloads and scales."""
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QuantizedPair:
        """The same pair on `device` (still compressed: the copy moves one byte per value)."""
        return QuantizedPair(
            self.k.to(device, non_blocking=non_blocking),
            self.v.to(device, non_blocking=non_blocking),
            self.k_scale.to(device, non_blocking=non_blocking),
            self.v_scale.to(device, non_blocking=non_blocking),
            self.dtype,
        )

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V in `dtype`, computed where the tensors are."""
        return (
            dequantize(self.k, self.k_scale, self.dtype),
            dequantize(self.v, self.v_scale, self.dtype),
        )


def quantize_pair(k: torch.Tensor, v: torch.Tensor, encoding: str) -> QuantizedPair:
    """One layer's K and V ([H_kv, n, D]) in a compressed encoding."""
    qk, k_scale = quantize(k, encoding)
    qv, v_scale = quantize(v, encoding)
    return QuantizedPair(qk, qv, k_scale, v_scale, k.dtype)


def round_trip(kv: ChunkKV, encoding: str) -> ChunkKV:
    """`kv` as a reader of an entry stored in `encoding` gets it back ("none": `kv` itself)."""
    if check_encoding(encoding) == "none":
        return kv
    qk, k_scale = quantize(kv.keys, encoding)
    qv, v_scale = quantize(kv.values, encoding)
    dtype = kv.keys.dtype
    return ChunkKV(dequantize(qk, k_scale, dtype), dequantize(qv, v_scale, dtype))
