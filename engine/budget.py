"""A step's budget of prefill work, shared by the step's pausable prefills: a prefill is a
generator that computes pieces while the budget lasts and yields when it is spent."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from engine.dense import Pausable

# The fewest rows a piece computes: smaller pieces would spend the step on per-call overhead.
MIN_PIECE_ROWS = 16


# The weight of a new measurement in the running seconds per token-layer.
SMOOTHING = 0.2

# Slack shorter than this many of a step's allowances is banked, not lent (`StepBudget.lend`).
MIN_LENT_ALLOWANCES = 4


@dataclass
class StepBudget:
    """Token-layers (one token through one decoder layer) a prefill may still compute in this
    step; infinite when nothing decodes, so a lone prefill runs whole, exactly as unpaused.

    The budget is also a time allowance: its token-layers x the seconds a token-layer takes
    where a layer computes every prompt token (a full prefill's layers, a blend's before its
    first check), learnt from such pieces of bounded steps as they run (`observe`). The step's
    prefill work ends when either is spent. A blend's rows after its first check cost more
    each (they attend over the whole prompt, its streamed KV is put in place, its check runs):
    counted by rows alone its steps took ~1.5x a full prefill's on the CPU; the allowance
    holds them to a full prefill's time. Until a piece was measured, and where kernels run
    asynchronously (the host's clock sees little of them), the count rules."""

    left: float = math.inf
    seconds_per_token: float = 0.0  # learnt by `observe`; 0: not yet
    deadline_s: float = math.inf  # perf_counter time the allowance ends
    shared: bool = False  # prefills side by side: a piece's time holds the others' work too
    # One prefill in its forward, nothing beside it (no other prefill, no decode rows): its
    # layers' times are its own work (the executor sets it per batch).
    alone: bool = True
    # Running sums of the measured pieces' token-layers and seconds (`observe`).
    _measured: tuple[float, float] = (0.0, 0.0)
    _last_pace: float = 0.0  # seconds per token-layer of the last piece measured

    def refill(self, token_layers: float) -> None:
        """A new step's budget: `token_layers` to spend, and as much time as they take."""
        self.left, self.deadline_s = token_layers, self._deadline(token_layers)
        self._last_pace = 0.0

    def bound(self, token_layers: float) -> None:
        """Spend at most `token_layers` more (and their time) from now."""
        self.left = min(self.left, token_layers)
        self.deadline_s = min(self.deadline_s, self._deadline(token_layers))

    def lend(self, seconds: float, bank: bool = True) -> None:
        """The decoding sequences can wait `seconds` (their slack). Where that is at least
        MIN_LENT_ALLOWANCES x the step's allowance, only that time bounds its prefills. Where
        it is less, with `bank`, they wait: the step decodes alone, and its sequences keep
        what it leaves of their slack for a later, longer piece (on the CPU a prefill in pieces
        of one 128-token allowance took ~1.7x its whole time, in pieces of 512 ~1.1x: small
        matmuls and masked attention cost more per row); without `bank` (prefills that fit in
        the count whole) the allowance stands. Needs a learnt pace (pieces are sized by it)."""
        if self.seconds_per_token <= 0.0:
            return
        now = time.perf_counter()
        if seconds >= MIN_LENT_ALLOWANCES * (self.deadline_s - now):
            self.left, self.deadline_s = math.inf, now + seconds
        elif bank:
            self.left, self.deadline_s = 0.0, now
        elif now + seconds > self.deadline_s:
            self.left, self.deadline_s = math.inf, now + seconds

    def _deadline(self, token_layers: float) -> float:
        if self.seconds_per_token <= 0.0 or math.isinf(token_layers):
            return math.inf
        return time.perf_counter() + token_layers * self.seconds_per_token

    @property
    def spent(self) -> bool:
        return self.left <= 0 or time.perf_counter() >= self.deadline_s

    def piece(self, rows_left: int) -> int:
        """How many of a layer's remaining rows the next piece computes: as many as the count
        and the time left allow, at least MIN_PIECE_ROWS (it may overshoot by fewer)."""
        left = self.left
        if not math.isinf(self.deadline_s):
            pace = max(self.seconds_per_token, self._last_pace)
            left = min(left, (self.deadline_s - time.perf_counter()) / pace)
        if math.isinf(left):
            return rows_left
        return min(rows_left, max(math.ceil(left), MIN_PIECE_ROWS))

    def spend(self, token_layers: int) -> None:
        self.left -= token_layers

    def observe(self, token_layers: int, seconds: float, every_row: bool = False) -> None:
        """A piece of `token_layers` took `seconds`: the next piece is sized by its pace (if
        slower than the learnt one). `every_row`: its layer computes every token of the
        prefill; the budget learns that pace, weighted by the pieces' sizes (a piece's fixed
        costs weigh on a small one), from pieces of bounded steps only (a whole layer runs
        faster per token than the pieces a bounded step computes) and of one prefill at a
        time."""
        if math.isinf(self.left) or self.shared or token_layers <= 0:
            return
        self._last_pace = seconds / token_layers
        if not every_row:
            return
        tokens, seconds_sum = self._measured
        tokens = (1 - SMOOTHING) * tokens + SMOOTHING * token_layers
        seconds_sum = (1 - SMOOTHING) * seconds_sum + SMOOTHING * seconds
        self._measured = tokens, seconds_sum
        self.seconds_per_token = seconds_sum / tokens


def wait(budget: StepBudget) -> Pausable[float]:
    """Yield until the step's driver hands the budget more work; the seconds paused."""
    if not budget.spent:
        return 0.0
    start = time.perf_counter()
    while budget.spent:
        yield None
    return time.perf_counter() - start


def decode_slack_s(seqs: list[tuple[float, int]], target_gap_s: float, now: float) -> float:
    """How long the next step may take before a decoding sequence's mean time per token, from
    its first token through the one the step gives it, passes `target_gap_s`; `seqs`: each
    one's (first token time, tokens so far). The least over them (inf: none)."""
    return min((first + target_gap_s * tokens - now for first, tokens in seqs), default=math.inf)
