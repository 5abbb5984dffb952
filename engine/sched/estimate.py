"""How long a request arriving now waits before its prefill starts, from what waits and runs
and the measured speed of recent steps. Plain Python on counts, testable without a model."""

from __future__ import annotations

import heapq
import math

from engine.sched.scheduler import MIN_PREFILL_TOKENS, Scheduler, prefill_budget
from engine.types import StepRecord

# Weight of the newest step in the running averages: recent load counts, one outlier fades.
SMOOTHING = 0.2


class QueueEstimate:
    """Running averages of prefill throughput (prompt tokens/s) and decode time, fed every step.

    The wait of a new request is the prefill of every prompt token ahead of it (waiting, or in
    flight: counted whole, an upper bound) at the measured throughput, plus the decodes that
    share the steps: while sequences decode, a step gives prefills at most `step_tokens`, so
    the prompts ahead take ceil(tokens / step_tokens) steps, each with one decode (unbounded:
    one decode per prompt ahead, and one after the newest). Where the decodes are fused into the
    prefills' forward (the engine's last step that ran both said so) their time is in the
    measured prefill throughput already, and no decode step is added. When the KV pool admits
    no more the request also waits for a lane (`lane_wait_steps`): each sequence holds its lane
    until its max_tokens are decoded (EOS or a stop string ends it sooner: an upper bound), and
    the sequences waiting ahead take the lanes that free first. Before a step of a kind was
    measured it counts as free.
    """

    def __init__(self) -> None:
        self.prefill_tokens_per_s: float | None = None
        self.decode_step_s: float | None = None
        self._prefill_s = 0.0  # prefill seconds since a prefill last completed
        self.decodes_fused = False  # decodes run in the prefills' forward (StepRecord.decode_fused)

    def wait_for(self, scheduler: Scheduler) -> float:
        """`wait_s` for what `scheduler` holds now (call it under the lock that guards it): a
        step gives the prompts ahead what its budget leaves beside the sequences decoding now,
        each counting its decode weight, at least a prefill's floor."""
        ahead = [*scheduler.prefilling, *scheduler.waiting]
        budget = scheduler.max_num_batched_tokens
        step_tokens = math.inf
        if budget is not None:  # with nothing decoding now, prefill_budget's inf: the budget
            left = prefill_budget(budget, len(scheduler.decoding), scheduler.decode_weight)
            step_tokens = max(MIN_PREFILL_TOKENS, min(budget, left))
        return self.wait_s(
            waiting_tokens=sum(seq.num_prompt_tokens for seq in ahead),
            waiting_max_tokens=[seq.max_tokens for seq in scheduler.waiting],
            in_flight=len(scheduler.prefilling),
            running_remaining=lane_holders_remaining(scheduler),
            startable=scheduler.startable_now(),
            step_tokens=step_tokens,
        )

    def room_after_s(self, running_remaining: list[int]) -> float:
        """Seconds until the first sequence holding a lane ends at the latest (after its
        remaining max_tokens), which lets a full queue take another request: a 429's
        Retry-After. 0 while nothing holds a lane or no decode step was measured."""
        return min(running_remaining, default=0) * (self.decode_step_s or 0.0)

    def observe(self, step: StepRecord) -> None:
        if step.num_decodes and step.num_prefills:
            self.decodes_fused = step.decode_fused
        if step.num_decodes and step.decode_s > 0.0:
            self.decode_step_s = smoothed(self.decode_step_s, step.decode_s)
        # A prefill in pieces spends several steps: its throughput counts once it completes.
        self._prefill_s += step.prefill_s
        if step.prefill_tokens and self._prefill_s > 0.0:
            rate = step.prefill_tokens / self._prefill_s
            self.prefill_tokens_per_s = smoothed(self.prefill_tokens_per_s, rate)
            self._prefill_s = 0.0

    def wait_s(
        self,
        *,
        waiting_tokens: int,
        waiting_max_tokens: list[int],
        running_remaining: list[int],
        startable: int,
        step_tokens: float = math.inf,
        in_flight: int = 0,
    ) -> float:
        """`waiting_tokens`: the prompt tokens of the waiting sequences and of the `in_flight`
        prefills (which hold blocks); `waiting_max_tokens`: each waiting sequence's, in queue
        order; `running_remaining`: tokens each sequence holding a lane (decoding, or in
        flight) may still decode; `startable`: sequences the pool would start now
        (Scheduler.startable_now)."""
        waiting_seqs = len(waiting_max_tokens)
        prompts_ahead = waiting_seqs + in_flight
        if not prompts_ahead and not running_remaining:
            return 0.0
        prefill_s = waiting_tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s else 0.0
        interleaved_steps = prompts_ahead
        if running_remaining and self.decodes_fused:
            interleaved_steps = 0
        elif running_remaining:
            pieces = prompts_ahead if math.isinf(step_tokens) else waiting_tokens / step_tokens
            interleaved_steps = math.ceil(pieces) + 1
        lane_steps = lane_wait_steps(running_remaining, waiting_max_tokens, startable)
        decode_steps = max(interleaved_steps, lane_steps)
        return prefill_s + decode_steps * (self.decode_step_s or 0.0)


def lane_holders_remaining(scheduler: Scheduler) -> list[int]:
    """The tokens each sequence holding a lane (prefilling or decoding) may still decode."""
    holders = [*scheduler.prefilling, *scheduler.decoding]
    return [seq.max_tokens - seq.num_output_tokens for seq in holders]


def lane_wait_steps(
    running_remaining: list[int], waiting_max_tokens: list[int], startable: int
) -> int:
    """Decode steps until a lane is free for a request behind the waiting sequences: the free
    lanes are free now, a running sequence's when its remaining tokens are decoded; each waiting
    sequence, in order, takes the lane that frees first and holds it for its max_tokens. 0 when
    no lane is known (nothing runs and none is free: the pool's limits, not a wait)."""
    lanes = [0] * max(startable, 0) + list(running_remaining)
    if not lanes:
        return 0
    heapq.heapify(lanes)
    for max_tokens in waiting_max_tokens:
        heapq.heapreplace(lanes, lanes[0] + max_tokens)
    return lanes[0]


def smoothed(old: float | None, new: float) -> float:
    """A running average that gives the newest value SMOOTHING of the weight."""
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
