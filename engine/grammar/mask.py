"""Logits masked by a grammar's next-token bitmask: int32 words, bit i of word j allowing token
32 * j + i (the layout llguidance and xgrammar both fill)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

BITS = 32
# Per (device, dtype): byte value -> the additive bias of its 8 tokens, 0 (allowed) or -inf.
# A lookup and an add cost a quarter of masked_fill on CPU (bench/structured_output.py).
_byte_bias: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    """Words of one row of the bitmask of a `vocab_size` vocabulary."""
    return (vocab_size + BITS - 1) // BITS


def _bias_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    table = _byte_bias.get((device, dtype))
    if table is None:
        byte = torch.arange(256)
        allowed = ((byte[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8], little-endian bits
        table = torch.where(allowed, 0.0, float("-inf")).to(device, dtype)
        _byte_bias[(device, dtype)] = table
    return table


def token_bias(
    bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The bitmask [k, W] int32 (CPU) as an additive bias [k, vocab_size] on `device`: 0 where
    a token is allowed, -inf where not."""
    k = bitmask.shape[0]
    # int32 words are little-endian in memory: byte b of word j holds tokens 32j + 8b ... + 7.
    # Bytes cross to the device (a quarter of the longs they index with), then widen there.
    byte_ids = bitmask.view(torch.uint8).to(device).long()  # [k, 4W]
    return F.embedding(byte_ids, _bias_table(device, dtype)).reshape(k, -1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Logits [B, V] with row rows[i] masked by bitmask row i (-inf where not allowed), as a
    new tensor: the caller's logits stay the model's own (the shadow check reads them)."""
    bias = token_bias(bitmask[: len(rows)], logits.shape[-1], logits.dtype, logits.device)
    return logits.index_add(0, rows.to(logits.device), bias)
