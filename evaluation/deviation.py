"""How far a blended prompt's KV cache is from full prefill's: the relative squared deviation
of the chunk tokens' keys and values over all layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.blend.prefill import Prefill


def kv_deviation(
    keys: torch.Tensor,
    values: torch.Tensor,
    ref_keys: torch.Tensor,
    ref_values: torch.Tensor,
    spans: Sequence[tuple[int, int]],
) -> float:
    """Σ‖ΔK‖²+‖ΔV‖² over chunk tokens and all layers, relative to the reference's Σ‖K‖²+‖V‖².
    Tensors are [layers, kv_heads, tokens, head_dim]; spans are (start, length) of each chunk."""
    if not spans:
        return 0.0
    index = torch.cat([torch.arange(start, start + length) for start, length in spans])
    k, v = keys[:, :, index].float(), values[:, :, index].float()
    rk, rv = ref_keys[:, :, index].float(), ref_values[:, :, index].float()
    num = (k - rk).pow(2).sum() + (v - rv).pow(2).sum()
    return float(num / (rk.pow(2).sum() + rv.pow(2).sum()))


def prefill_deviation(prefill: Prefill, reference: Prefill) -> float:
    """kv_deviation of a prefill's KV from the reference's, over the reference's chunks."""
    return kv_deviation(
        prefill.output.keys,
        prefill.output.values,
        reference.output.keys,
        reference.output.values,
        reference.layout.chunk_spans,
    )
