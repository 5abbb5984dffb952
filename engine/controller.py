"""Chooses the recompute ratio and the leading full layers from measured speeds (paper §5).

Blending costs, per layer, max(load time, recompute time); the controller recomputes as much
as loading hides (r = max(r_min, load / compute)) and falls back to full prefill when loading a
layer takes longer than computing it, so blending is never slower than full prefill.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from engine.types import DEFAULT_RECOMPUTE_RATIO

# Before anything was measured: conservative host-memory and SSD read speeds.
DEFAULT_BANDWIDTH_BPS = {"memory": 8e9, "ssd": 1e9}
_EWMA = 0.3


@dataclass(frozen=True)
class Decision:
    recompute_ratio: float
    leading_layers: int  # layers computed fully before the (first) check layer
    full_prefill: bool  # blending would be slower: compute everything, load nothing
    layer_compute_s: float  # estimated full compute of one layer
    layer_load_s: float  # estimated load of one layer of KV


def decide(
    layer_compute_s: float,
    layer_load_s: float,
    num_layers: int,
    min_ratio: float,
    min_leading_layers: int,
) -> Decision:
    """The pure rule: recompute what loading hides, lead with enough full layers that the
    first blended layer's KV has arrived, and give up on blending when loads are the slower."""
    if layer_compute_s <= 0.0:
        return Decision(min_ratio, min_leading_layers, False, layer_compute_s, layer_load_s)
    load_ratio = layer_load_s / layer_compute_s
    if load_ratio >= 1.0:
        return Decision(1.0, num_layers, True, layer_compute_s, layer_load_s)
    leading = min(num_layers - 1, max(min_leading_layers, math.ceil(load_ratio)))
    return Decision(max(min_ratio, load_ratio), leading, False, layer_compute_s, layer_load_s)


class Controller:
    """Keeps moving averages of load bandwidth per tier and compute time per token-layer."""

    def __init__(self, min_ratio: float = DEFAULT_RECOMPUTE_RATIO, min_leading_layers: int = 1):
        self.min_ratio = min_ratio
        self.min_leading_layers = min_leading_layers
        self.bandwidth_bps = dict(DEFAULT_BANDWIDTH_BPS)
        self._measured_tiers: set[str] = set()
        self.token_layer_s: float | None = None
        self._lock = threading.Lock()

    def observe_load(self, tier: str, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0.0:
            return
        with self._lock:
            measured = num_bytes / seconds
            if tier in self._measured_tiers:  # the first measurement replaces the prior
                measured = (1 - _EWMA) * self.bandwidth_bps[tier] + _EWMA * measured
            self.bandwidth_bps[tier] = measured
            self._measured_tiers.add(tier)

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        """One layer computed for `num_tokens` tokens in `seconds`."""
        if num_tokens < 16 or seconds <= 0.0:
            return  # tiny layers are dominated by overheads, not by tokens
        with self._lock:
            measured = seconds / num_tokens
            previous = self.token_layer_s
            self.token_layer_s = (
                measured if previous is None else (1 - _EWMA) * previous + _EWMA * measured
            )

    def decide(
        self, num_tokens: int, layer_bytes_by_tier: dict[str, int], num_layers: int
    ) -> Decision:
        """Ratio and leading layers for a prompt of `num_tokens` computed tokens whose chunk KV
        takes `layer_bytes_by_tier` bytes per layer."""
        with self._lock:
            compute_s = (self.token_layer_s or 0.0) * num_tokens
            load_s = sum(
                n / self.bandwidth_bps.get(tier, DEFAULT_BANDWIDTH_BPS["ssd"])
                for tier, n in layer_bytes_by_tier.items()
            )
        return decide(compute_s, load_s, num_layers, self.min_ratio, self.min_leading_layers)
