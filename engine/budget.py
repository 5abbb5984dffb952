"""A step's budget of prefill work, shared by the step's pausable prefills: a prefill is a
generator that computes pieces while the budget lasts and yields when it is spent."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TypeVar

import torch

from engine.dense import Pausable, resume

T = TypeVar("T")


# The fewest rows a piece computes: smaller pieces would spend the step on per-call overhead.
MIN_PIECE_ROWS = 16


@dataclass
class StepBudget:
    """Token-layers (one token through one decoder layer) a prefill may still compute in this
    step; infinite when nothing decodes, so a lone prefill runs whole, exactly as unpaused.

    A row's attention counts too: a row that attends over n keys costs 1 + n / keys_per_token
    token-layers, where `keys_per_token` is how many keys one row reads for the price of its
    dense work. With `seconds_per_token` (a row's dense work through a layer) a step's budget
    is also a time allowance, its token-layers x seconds_per_token: the step's prefill work
    ends when either is spent, so work the counts leave out (a blend's streamed KV put in
    place, its check, kernels slower than the probe's) still ends the step in time. On a
    device that runs kernels asynchronously the host's clock sees little and the counts rule.
    engine/step_cost.py measures both; the defaults count rows alone. Counting rows alone, a
    blend's step (its rows attend over the whole prompt) took twice a full prefill's time on
    the CPU."""

    left: float = math.inf
    keys_per_token: float = math.inf
    seconds_per_token: float = 0.0
    deadline_s: float = math.inf  # perf_counter time the allowance ends

    def refill(self, token_layers: float) -> None:
        """A new step's budget: `token_layers` to spend, and as much time as they take."""
        self.left, self.deadline_s = token_layers, self._deadline(token_layers)

    def bound(self, token_layers: float) -> None:
        """Spend at most `token_layers` more (and their time) from now."""
        self.left = min(self.left, token_layers)
        self.deadline_s = min(self.deadline_s, self._deadline(token_layers))

    def _deadline(self, token_layers: float) -> float:
        if self.seconds_per_token <= 0.0 or math.isinf(token_layers):
            return math.inf
        return time.perf_counter() + token_layers * self.seconds_per_token

    @property
    def spent(self) -> bool:
        return self.left <= 0 or time.perf_counter() >= self.deadline_s

    def piece(
        self, positions: list[int], start: int, window: int | None = None, attends: bool = True
    ) -> tuple[int, float]:
        """The end of the next piece of a layer's rows at `positions[start:]` (sorted) and its
        cost: rows while the budget and the time left last, at least MIN_PIECE_ROWS (so a
        piece may overshoot by less than that many rows). `attends=False`: rows only projected
        (a check layer's)."""
        left = self.left
        if self.seconds_per_token > 0.0 and not math.isinf(self.deadline_s):
            left = min(left, (self.deadline_s - time.perf_counter()) / self.seconds_per_token)
        if math.isinf(left):
            return len(positions), 0.0
        per_key = 0.0 if not attends or math.isinf(self.keys_per_token) else 1 / self.keys_per_token
        end, cost = start, 0.0
        for position in positions[start:]:
            keys = position + 1 if window is None else min(position + 1, window)
            row = 1.0 + keys * per_key
            if end - start >= MIN_PIECE_ROWS and cost + row > left:
                break
            cost += row
            end += 1
        return end, cost

    def spend(self, token_layers: float) -> None:
        self.left -= token_layers


def wait(budget: StepBudget) -> Pausable[float]:
    """Yield until the step's driver hands the budget more work; the seconds paused."""
    if not budget.spent:
        return 0.0
    start = time.perf_counter()
    while budget.spent:
        yield None
    return time.perf_counter() - start


def run_to_end(pausable: Pausable[T]) -> T:
    """Drive a prefill whose budget is never spent (an unbounded one) to its result."""
    done, result = advance(pausable)
    if not done:
        raise RuntimeError("an unbounded prefill paused")
    return result  # type: ignore[return-value]


def advance(pausable: Pausable[T]) -> tuple[bool, T | None]:
    """Run a prefill until it pauses (False, None) or returns (True, its result), its dense work
    run as it comes. Inference mode is entered per resumption: a mode held across a yield
    would leak into the caller."""
    with torch.inference_mode():
        done, work, result = resume(pausable)
        while work is not None:
            done, work, result = resume(pausable, work.run())
    return done, result
