"""How long a request arriving now waits before its prefill starts, from what waits and runs
and the measured speed of recent steps. Plain Python on counts, testable without a model."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.scheduler import Scheduler

# Weight of the newest step in the running averages: recent load counts, one outlier fades.
SMOOTHING = 0.2


class QueueEstimate:
    """Running averages of prefill throughput (tokens/s) and decode step time, fed every step.

    The wait of a new request is the prefill of every prompt token waiting ahead of it at
    the measured throughput, plus the decode steps that run in between: the scheduler puts
    one decode step after every prefill step while sequences run, and when every KV slot is
    taken the request also waits until enough running sequences end, at worst after their
    remaining max_tokens (EOS or a stop string ends them sooner: an upper bound). Before a
    step of a kind was measured it counts as free.
    """

    def __init__(self) -> None:
        self.prefill_tokens_per_s: float | None = None
        self.decode_step_s: float | None = None

    def wait_for(self, scheduler: Scheduler) -> float:
        """`wait_s` for what `scheduler` holds now (call it under the lock that guards it)."""
        return self.wait_s(
            waiting_tokens=sum(seq.num_prompt_tokens for seq in scheduler.waiting),
            waiting_seqs=len(scheduler.waiting),
            running_remaining=[s.max_tokens - s.num_output_tokens for s in scheduler.running],
            free_slots=scheduler.slots.num_free,
        )

    def observe(self, is_prefill: bool, num_tokens: int, seconds: float) -> None:
        if seconds <= 0.0:
            return
        if is_prefill:
            self.prefill_tokens_per_s = _average(self.prefill_tokens_per_s, num_tokens / seconds)
        else:
            self.decode_step_s = _average(self.decode_step_s, seconds)

    def wait_s(
        self,
        *,
        waiting_tokens: int,
        waiting_seqs: int,
        running_remaining: list[int],
        free_slots: int,
    ) -> float:
        """`running_remaining`: tokens each running sequence may still decode."""
        if not waiting_seqs and not running_remaining:
            return 0.0
        prefill_s = waiting_tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s else 0.0
        # One decode step may follow each prefill ahead, and the one after the newest prefill.
        interleaved_steps = waiting_seqs + 1 if running_remaining else waiting_seqs
        # Slots the request needs freed: one for each waiting sequence ahead, one for itself.
        slots_short = waiting_seqs + 1 - free_slots
        slot_wait_steps = 0
        if slots_short > 0 and running_remaining:
            ends = sorted(running_remaining)
            slot_wait_steps = ends[min(slots_short, len(ends)) - 1]
        decode_steps = max(interleaved_steps, slot_wait_steps)
        return prefill_s + decode_steps * (self.decode_step_s or 0.0)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
