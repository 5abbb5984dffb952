"""A decode step's logits masked to each sequence's grammar: rows of sequences with one get
their grammar's bitmask, rows without cost nothing."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.grammar.compile import SequenceGrammar
from engine.grammar.mask import apply_bitmask, bitmask_words


class GrammarMasks:
    """A bitmask buffer of `num_rows` rows (the most sequences a step decodes), filled anew
    each step for the sequences that have a grammar."""

    def __init__(self, num_rows: int, vocab_size: int):
        # [num_rows, W] int32 on the CPU, where the matchers write.
        self.bitmask = torch.zeros(num_rows, bitmask_words(vocab_size), dtype=torch.int32)

    def apply(
        self, grammars: Sequence[SequenceGrammar | None], logits: torch.Tensor
    ) -> torch.Tensor:
        """Logits [B, V] with row i masked to what grammars[i] allows next; the same tensor
        when no row has a grammar, else a new one (the model's own logits stay as they were)."""
        rows = [i for i, grammar in enumerate(grammars) if grammar is not None]
        if not rows:
            return logits
        for k, i in enumerate(rows):
            grammars[i].fill(self.bitmask[k])  # type: ignore[union-attr]
        return apply_bitmask(logits, self.bitmask[: len(rows)], torch.tensor(rows))
