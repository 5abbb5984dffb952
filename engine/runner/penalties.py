"""Sampling penalties (engine.types.Penalties) applied to a batch of logits at once, from
per-lane token counts kept up to date token by token (a lane: the small id of a running
sequence, engine/sched/scheduler.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.types import Penalties


class PenaltyState:
    """What the penalties of the sequence in each lane need: how often each token was
    generated, and which tokens the prompt holds. Rows are reset when a penalised sequence
    starts in a lane and are not read for sequences without penalties."""

    def __init__(self, num_lanes: int, vocab_size: int, device: torch.device):
        # counts: [lanes, V], float32 so that frequency * counts needs no cast (exact up to 2**24).
        self.counts = torch.zeros(num_lanes, vocab_size, dtype=torch.float32, device=device)
        self.in_prompt = torch.zeros(num_lanes, vocab_size, dtype=torch.bool, device=device)
        self.device = device

    def start(self, lane: int, prompt_token_ids: Sequence[int]) -> None:
        """A sequence with penalties begins in `lane`: no output yet, this prompt."""
        self.counts[lane].zero_()
        self.in_prompt[lane].zero_()
        self.in_prompt[lane, torch.tensor(list(prompt_token_ids), device=self.device)] = True

    def add(self, lane: int, token_id: int) -> None:
        """The sequence in `lane` generated `token_id`."""
        self.counts[lane, token_id] += 1.0

    def apply(
        self, logits: torch.Tensor, lanes: Sequence[int], penalties: Sequence[Penalties]
    ) -> torch.Tensor:
        """Logits [B, V] of the sequences in `lanes`, each penalised by its own penalties; the
        same tensor when none has any. Rows without penalties come back bit for bit unchanged
        (x / 1, x * 1 and x - 0 are exact)."""
        if all(p.neutral for p in penalties):
            return logits
        index = torch.tensor(list(lanes), device=logits.device)
        counts = self.counts[index]  # [B, V]
        generated = counts > 0
        # presence, frequency, repetition: [B, 1]
        presence, frequency, repetition = torch.tensor(
            [(p.presence, p.frequency, p.repetition) for p in penalties],
            dtype=logits.dtype,
            device=logits.device,
        ).T[:, :, None]
        scale = torch.where(self.in_prompt[index] | generated, repetition, 1.0)
        logits = torch.where(logits > 0, logits / scale, logits * scale)
        return logits - frequency * counts - presence * generated
