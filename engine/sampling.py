"""Next-token choice: greedy, or temperature + nucleus (top-p) sampling with a seeded generator."""

from __future__ import annotations

import torch


class Sampler:
    def __init__(self, temperature: float, top_p: float, seed: int | None):
        self.temperature = temperature
        self.top_p = top_p
        # Sampling on the CPU makes a seed give the same tokens on every device.
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """One token id from logits [vocab]."""
        if self.temperature == 0.0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p (the first token always stays).
            outside = sorted_probs.cumsum(0) - sorted_probs >= self.top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
