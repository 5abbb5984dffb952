"""Next-token choice: greedy, or temperature + nucleus (top-p) sampling with a seeded generator."""

from __future__ import annotations

import torch

SEED_SPACE = 2**64  # a request's seed is any int, taken modulo 2**64
_LOW = 2**32 - 1
_GOLDEN = 0x9E3779B1  # odd, so multiplying by it is a bijection modulo 2**32


def generator_seed(seed: int) -> int:
    """The seed given to torch's CPU generator, whose mt19937 keeps only the low 32 bits of it:
    the high half is folded into the low one (a bijection for each low half), so seeds that
    differ only above bit 31 do not sample alike. Seeds in [0, 2**32) are kept as they are."""
    seed %= SEED_SPACE
    return (seed & _LOW) ^ (((seed >> 32) * _GOLDEN) & _LOW)


class Sampler:
    def __init__(self, temperature: float, top_p: float, seed: int | None):
        self.temperature = temperature
        self.top_p = top_p
        # Sampling on the CPU makes a seed give the same tokens on every device.
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(generator_seed(seed))

    def __call__(self, logits: torch.Tensor) -> int:
        """One token id from logits [vocab]; any temperature > 0 and top_p in (0, 1] are safe:
        a temperature too small to divide by leaves the top token alone, i.e. greedy."""
        if self.temperature == 0.0:
            return int(logits.argmax())
        logits64 = logits.detach().to("cpu", torch.float64)
        probs = torch.softmax(self._scaled(logits64), dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p; the top token always stays, even
            # for a top_p below the smallest float of the tensor.
            outside = sorted_probs.cumsum(0) - sorted_probs >= self.top_p
            outside[0] = False
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        total = float(probs.sum())
        if not (torch.isfinite(probs).all() and total > 0.0):
            return int(logits64.argmax())  # logits that were not finite: nothing to sample from
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def sampled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits [vocab] whose softmax this sampler draws from, before top-p: float64 on
        the CPU, divided by the temperature (greedy: as they are). A request's logprobs are
        their log-softmax."""
        logits64 = logits.detach().to("cpu", torch.float64)
        return logits64 if self.temperature == 0.0 else self._scaled(logits64)

    def _scaled(self, logits64: torch.Tensor) -> torch.Tensor:
        # float64 and the max subtracted first: a temperature like 1e-246 (0 in float32) gives
        # -inf for every token but the top ones, never inf - inf.
        return (logits64 - logits64.max()) / self.temperature
