"""A prefill's budget of work in one engine step: the token-layers (one token through one decoder
layer) it may still compute. A prefill is a generator that computes pieces while its budget
lasts and yields when it is spent; the scheduler sizes each budget from token counts alone."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from engine.blend.dense import Pausable

# The fewest rows a piece computes: smaller pieces would spend the step on per-call overhead.
MIN_PIECE_ROWS = 16


@dataclass
class StepBudget:
    """Token-layers one prefill may still compute in this step; infinite when nothing decodes,
    so a lone prefill runs whole, exactly as unpaused. `alone`: its forward holds nothing else
    (no other prefill, no decode rows), so its layers' times are its own work (the executor
    sets it per batch)."""

    left: float = math.inf
    alone: bool = True
    used: float = 0.0  # token-layers spent in every step so far

    def refill(self, token_layers: float) -> None:
        """A new step's budget."""
        self.left = token_layers

    def bound(self, token_layers: float) -> None:
        """Spend at most `token_layers` more in this step."""
        self.left = min(self.left, token_layers)

    @property
    def spent(self) -> bool:
        return self.left <= 0

    def piece(self, rows_left: int) -> int:
        """How many of a layer's remaining rows the next piece computes: as many as the budget
        allows, at least MIN_PIECE_ROWS (it may overshoot by fewer)."""
        if math.isinf(self.left):
            return rows_left
        return min(rows_left, max(math.ceil(self.left), MIN_PIECE_ROWS))

    def spend(self, token_layers: int) -> None:
        self.left -= token_layers
        self.used += token_layers


def wait(budget: StepBudget) -> Pausable[float]:
    """Yield until the step's driver hands the budget more work; the seconds paused."""
    if not budget.spent:
        return 0.0
    start = time.perf_counter()
    while budget.spent:
        yield None
    return time.perf_counter() - start
