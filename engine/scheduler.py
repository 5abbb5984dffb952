"""Waiting and running sequences, and the choice of what one engine step does.

A step either admits waiting sequences into free KV slots and prefills them (bounded by a
token budget), or decodes one token for every running sequence as one batch. After a prefill
step a decode step follows whenever sequences run, so a stream of arrivals never starves the
decodes in flight. Plain Python: the tensors live in the runner.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from engine.errors import QueueFullError
from engine.sequence import Sequence, SequenceStatus
from engine.slots import SlotTable

S = TypeVar("S", bound=Sequence)


class Scheduler(Generic[S]):
    def __init__(self, slots: SlotTable, max_waiting: int, max_prefill_tokens: int):
        if max_waiting < 0 or max_prefill_tokens < 1:
            raise ValueError(
                f"need max_waiting >= 0 and max_prefill_tokens >= 1, got "
                f"{max_waiting} and {max_prefill_tokens}"
            )
        self.slots = slots
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[S] = deque()
        self.running: list[S] = []
        self._last_was_prefill = False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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

    def schedule(self) -> tuple[list[S], bool]:
        """The sequences of the next step and whether it is a prefill step."""
        if self.waiting and self.slots.num_free and not (self.running and self._last_was_prefill):
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
            self.running.extend(batch)
            self._last_was_prefill = True
            return batch, True
        self._last_was_prefill = False
        return list(self.running), False

    def finish(self, seq: S) -> None:
        """Take `seq` out of the queues and free its slot at once (done, failed or cancelled)."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
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
