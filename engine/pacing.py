"""How many prompt tokens a step's prefills may compute so that the gap between a decoding
sequence's tokens stays a bounded multiple of a decode step, from the measured step times."""

from __future__ import annotations

import math

from engine.estimate import smoothed
from engine.types import StepRecord


class Pacer:
    """Running averages of a decode's seconds and of a prefill's seconds per token-layer (one
    token through one layer), fed every step. `tokens()`: the prompt tokens whose prefill takes
    `prefill_decode_ratio` times a decode, so a step with both takes about 1 + ratio decodes;
    math.inf while either is unmeasured or without a ratio (max_num_batched_tokens alone)."""

    def __init__(self, prefill_decode_ratio: float | None, num_layers: int):
        if prefill_decode_ratio is not None and prefill_decode_ratio <= 0:
            raise ValueError(f"prefill_decode_ratio must be > 0, got {prefill_decode_ratio}")
        self.ratio = prefill_decode_ratio
        self.num_layers = num_layers
        self.decode_s: float | None = None
        self.token_layer_s: float | None = None

    def observe(self, step: StepRecord) -> None:
        if step.num_decodes and step.decode_s > 0.0:
            self.decode_s = smoothed(self.decode_s, step.decode_s)
        if step.prefill_token_layers and step.prefill_s > 0.0:
            per_token_layer = step.prefill_s / step.prefill_token_layers
            self.token_layer_s = smoothed(self.token_layer_s, per_token_layer)

    def tokens(self) -> float:
        if self.ratio is None or self.decode_s is None or self.token_layer_s is None:
            return math.inf
        return self.ratio * self.decode_s / (self.token_layer_s * self.num_layers)
