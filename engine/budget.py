"""A step's budget of prefill work, shared by the step's pausable prefills: a prefill is a
generator that computes pieces while the budget lasts and yields when it is spent."""

from __future__ import annotations

import math
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")

# A prefill, paused at each yield until the next step hands it budget again; returns its result.
Pausable = Generator[None, None, T]

# The fewest rows a piece computes: smaller pieces would spend the step on per-call overhead.
MIN_PIECE_ROWS = 16


@dataclass
class StepBudget:
    """Token-layers (one token through one decoder layer) a prefill may still compute in this
    step; infinite when nothing decodes, so a lone prefill runs whole, exactly as unpaused."""

    left: float = math.inf

    @property
    def spent(self) -> bool:
        return self.left <= 0

    def piece(self, rows_left: int) -> int:
        """How many of a layer's remaining rows the next piece computes (it may overshoot the
        budget by up to MIN_PIECE_ROWS - 1 token-layers)."""
        if math.isinf(self.left):
            return rows_left
        return min(rows_left, max(math.ceil(self.left), MIN_PIECE_ROWS))

    def spend(self, token_layers: int) -> None:
        self.left -= token_layers


def wait(budget: StepBudget) -> Pausable[float]:
    """Yield until the step's driver hands the budget more work; the seconds paused."""
    if not budget.spent:
        return 0.0
    start = time.perf_counter()
    while budget.spent:
        yield
    return time.perf_counter() - start


def run_to_end(pausable: Pausable[T]) -> T:
    """Drive a prefill whose budget is never spent (an unbounded one) to its result."""
    done, result = advance(pausable)
    if not done:
        raise RuntimeError("an unbounded prefill paused")
    return result  # type: ignore[return-value]


def advance(pausable: Pausable[T]) -> tuple[bool, T | None]:
    """Run a prefill until it pauses (False, None) or returns (True, its result). Inference
    mode is entered per resumption: a mode held across a yield would leak into the caller."""
    with torch.inference_mode():
        try:
            next(pausable)
        except StopIteration as stop:
            return True, stop.value
    return False, None
