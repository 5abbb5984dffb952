"""Waiting and running sequences, and the choice of what one engine step does.

Every step decodes one token for each sequence whose prompt is cached, and gives the prefills
in flight what is left of the step's token budget; a prefill that needs more pauses and goes
on in the next step, so a stream of arrivals never starves the decodes. Waiting sequences are
admitted into free KV slots once no prefill is in flight. Plain Python: tensors live in the
runner.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from engine.errors import QueueFullError
from engine.sequence import Sequence, SequenceStatus
from engine.slots import SlotTable

S = TypeVar("S", bound=Sequence)

# The fewest prefill tokens a step with decodes gives the prefills in flight, however many
# sequences decode: the prefills always progress.
MIN_PREFILL_TOKENS = 16


@dataclass
class Step(Generic[S]):
    """What one engine step runs: a token for each of `decodes`, then `prefills` in order
    (those in flight first) within the tokens `budget` leaves them. `paced_tokens`: the prompt
    tokens that fit in the time the engine allows a step's prefills (engine/pacing.py)."""

    decodes: list[S] = field(default_factory=list)
    prefills: list[S] = field(default_factory=list)
    max_num_batched_tokens: int | None = None
    paced_tokens: float = math.inf

    @property
    def sequences(self) -> list[S]:
        return [*self.decodes, *self.prefills]

    @property
    def prefill_tokens(self) -> float:
        return self.budget(len(self.decodes))

    def budget(self, num_decoding: int) -> float:
        """What the step leaves its prefills when `num_decoding` sequences wait for a token:
        max_num_batched_tokens less one token each, within the paced tokens, at least
        MIN_PREFILL_TOKENS; math.inf when none waits (a lone prefill runs whole)."""
        if not num_decoding:
            return math.inf
        left = math.inf
        if self.max_num_batched_tokens is not None:
            left = self.max_num_batched_tokens - num_decoding
        return max(min(left, self.paced_tokens), MIN_PREFILL_TOKENS)


class Scheduler(Generic[S]):
    """`max_num_batched_tokens`: the tokens one step feeds the model, decodes first (None: no
    bound; a step with decodes then runs its prefills whole). `max_prefill_tokens` bounds the
    prompt tokens admitted in one step (one sequence is always admitted)."""

    def __init__(
        self,
        slots: SlotTable,
        max_waiting: int,
        max_prefill_tokens: int,
        max_num_batched_tokens: int | None = None,
    ):
        if max_waiting < 0 or max_prefill_tokens < 1:
            raise ValueError(
                f"need max_waiting >= 0 and max_prefill_tokens >= 1, got "
                f"{max_waiting} and {max_prefill_tokens}"
            )
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError(f"need max_num_batched_tokens >= 1, got {max_num_batched_tokens}")
        self.slots = slots
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[S] = deque()
        self.prefilling: list[S] = []  # admitted, prompt not yet cached, in admission order
        self.decoding: list[S] = []

    @property
    def running(self) -> list[S]:
        """Every sequence that holds a KV slot."""
        return [*self.prefilling, *self.decoding]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def add(self, seq: S) -> None:
        """Queue `seq`; raises QueueFullError when the queue and the KV pool are both full.
        The engine refuses a sequence longer than a slot before it gets here."""
        assert seq.max_positions <= self.slots.slot_tokens, "longer than a KV slot"
        # Waiting sequences that free slots will take at the next step do not count as queued.
        if len(self.waiting) >= self.max_waiting + self.slots.num_free:
            raise QueueFullError(
                f"{len(self.waiting)} requests wait and all {self.slots.num_slots} KV slots are "
                f"in use"
            )
        self.waiting.append(seq)

    def schedule(self) -> Step[S]:
        """The next step: every sequence whose prompt is cached decodes; the prefills in flight
        (or, with none, newly admitted ones) share the tokens the decodes leave."""
        done = [seq for seq in self.prefilling if seq.num_cached >= seq.num_prompt_tokens]
        for seq in done:
            self.prefilling.remove(seq)
        self.decoding.extend(done)
        if not self.prefilling:
            self.prefilling = self._admit()
        return Step(list(self.decoding), list(self.prefilling), self.max_num_batched_tokens)

    def _admit(self) -> list[S]:
        """Waiting sequences into free slots, in order, within max_prefill_tokens."""
        batch: list[S] = []
        budget = self.max_prefill_tokens
        while self.waiting and self.slots.num_free:
            seq = self.waiting[0]
            if batch and seq.num_prompt_tokens > budget:
                break
            self.waiting.popleft()
            seq.slot = self.slots.allocate()
            seq.status = SequenceStatus.RUNNING
            budget -= seq.num_prompt_tokens
            batch.append(seq)
        return batch

    def finish(self, seq: S) -> None:
        """Take `seq` out of the queues and free its slot at once (done, failed or cancelled)."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            (self.prefilling if seq in self.prefilling else self.decoding).remove(seq)
            assert seq.slot is not None
            self.slots.release(seq.slot)
        seq.status = SequenceStatus.FINISHED

    def finish_done(self, seqs: list[S]) -> list[S]:
        """Finish those of `seqs` that have a finish reason; returns them."""
        done = [seq for seq in seqs if seq.finish_reason is not None]
        for seq in done:
            self.finish(seq)
        return done

    def drop_cancelled(self) -> list[S]:
        """Finish every cancelled sequence, waiting or running; returns them."""
        cancelled = [seq for seq in [*self.waiting, *self.running] if seq.cancelled]
        for seq in cancelled:
            self.finish(seq)
        return cancelled

    def cancel_all(self) -> None:
        for seq in [*self.waiting, *self.running]:
            seq.cancelled = True
