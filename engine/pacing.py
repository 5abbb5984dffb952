"""How many prompt tokens a step's prefills may compute so that the gap between a decoding
sequence's tokens stays a bounded multiple of a lone decode, from the measured step times."""

from __future__ import annotations

import math

from engine.estimate import smoothed
from engine.types import StepRecord


class Pacer:
    """Running averages of a decode step's seconds (of any batch, and of a lone sequence) and
    of a prefill's seconds per token-layer (one token through one layer), fed every step.

    `tokens()`: the prompt tokens that fill a step with decodes up to (1 + `ratio`) lone
    decodes, what is left after the decode batch's own time (none left: 0, the scheduler's
    floor applies). So a decoding sequence's time per token stays about 1 + ratio times its
    unloaded value, however many decode beside it, while prefills take the rest. math.inf
    while a speed is unmeasured (the token budget alone applies)."""

    def __init__(self, ratio: float, num_layers: int):
        if ratio <= 0:
            raise ValueError(f"prefill_decode_ratio must be > 0, got {ratio}")
        self.ratio = ratio
        self.num_layers = num_layers
        self.decode_s: float | None = None
        self.lone_decode_s: float | None = None
        self.token_layer_s: float | None = None

    def observe(self, step: StepRecord) -> None:
        if step.num_decodes and step.decode_s > 0.0:
            self.decode_s = smoothed(self.decode_s, step.decode_s)
            if step.num_decodes == 1:
                self.lone_decode_s = smoothed(self.lone_decode_s, step.decode_s)
        if step.prefill_token_layers and step.prefill_s > 0.0:
            per_token_layer = step.prefill_s / step.prefill_token_layers
            self.token_layer_s = smoothed(self.token_layer_s, per_token_layer)

    def tokens(self) -> float:
        if self.decode_s is None or self.token_layer_s is None:
            return math.inf
        lone = self.decode_s if self.lone_decode_s is None else self.lone_decode_s
        seconds = max((1 + self.ratio) * lone - self.decode_s, 0.0)
        return seconds / (self.token_layer_s * self.num_layers)
