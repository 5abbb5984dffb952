"""The scheduler and the slot table: admission by free KV slots and a prefill token budget,
every step decodes first and prefills in what its token budget leaves, 429 only when queue and
pool are full, slots freed at once."""

from __future__ import annotations

import math

import pytest

from engine.errors import QueueFullError
from engine.scheduler import MIN_PREFILL_TOKENS, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.slots import SlotTable


def seq(prompt_tokens: int, max_tokens: int = 4) -> Sequence:
    return Sequence(num_prompt_tokens=prompt_tokens, max_tokens=max_tokens)


def scheduler(
    slots: int = 2, max_waiting: int = 1, budget: int = 100, step_tokens: int | None = 32
) -> Scheduler:
    return Scheduler(SlotTable(slots, 64), max_waiting, budget, step_tokens)


def prefilled(*seqs: Sequence) -> None:
    """What the executor does when a prefill completes: the prompt is cached."""
    for x in seqs:
        x.num_cached = x.num_prompt_tokens


def test_the_lowest_free_slot_is_handed_out_first():
    table = SlotTable(4, 16)
    assert [table.allocate() for _ in range(3)] == [0, 1, 2]
    table.release(1)
    assert table.allocate() == 1
    table.release(0)
    assert table.allocate() == 0 and table.num_free == 1
    table.allocate()
    with pytest.raises(RuntimeError, match="no free KV slot"):
        table.allocate()


def test_waiting_sequences_are_admitted_while_slots_are_free():
    s = scheduler(slots=2, max_waiting=2)
    a, b, c = seq(10), seq(10), seq(10)
    for x in (a, b, c):
        s.add(x)
    step = s.schedule()
    assert step.prefills == [a, b] and not step.decodes and (a.slot, b.slot) == (0, 1)
    assert list(s.waiting) == [c] and c.status is SequenceStatus.WAITING


def test_with_nothing_decoding_the_prefills_of_a_step_run_whole():
    s = scheduler(slots=2, max_waiting=2, step_tokens=32)
    s.add(seq(40))
    assert math.isinf(s.schedule().prefill_tokens)


def test_every_step_decodes_the_cached_sequences_and_prefills_in_the_tokens_they_leave():
    s = scheduler(slots=3, max_waiting=3, step_tokens=32)
    a, b = seq(10), seq(10)
    s.add(a)
    s.schedule()
    prefilled(a)
    s.add(b)
    step = s.schedule()
    assert step.decodes == [a] and step.prefills == [b] and step.prefill_tokens == 31
    assert s.schedule().decodes == [a]  # b is still prefilling: it does not decode yet
    prefilled(b)
    step = s.schedule()
    assert step.decodes == [a, b] and not step.prefills


def test_no_sequence_is_admitted_while_a_prefill_is_in_flight():
    s = scheduler(slots=3, max_waiting=3)
    a, b = seq(10), seq(10)
    s.add(a)
    s.schedule()
    s.add(b)
    step = s.schedule()  # a paused at the end of the last step: it goes on, b waits
    assert step.prefills == [a] and list(s.waiting) == [b] and b.slot is None
    prefilled(a)
    assert s.schedule().prefills == [b]


def test_prefills_keep_a_minimum_share_of_a_step_that_many_decodes_fill():
    s = scheduler(slots=8, max_waiting=8, step_tokens=4)
    running = [seq(10) for _ in range(6)]
    for x in running:
        s.add(x)
    s.schedule()
    prefilled(*running)
    s.add(seq(10))
    step = s.schedule()
    assert len(step.decodes) == 6 and step.prefill_tokens == MIN_PREFILL_TOKENS


def test_without_a_token_budget_prefills_run_whole_beside_the_decodes():
    s = scheduler(slots=3, max_waiting=3, step_tokens=None)
    a, b = seq(10), seq(10)
    s.add(a)
    s.schedule()
    prefilled(a)
    s.add(b)
    step = s.schedule()
    assert step.decodes == [a] and step.prefills == [b] and math.isinf(step.prefill_tokens)


def test_the_prefill_token_budget_bounds_admission_but_always_admits_one():
    s = scheduler(slots=4, max_waiting=4, budget=25)
    big, small1, small2, small3 = seq(40), seq(10), seq(10), seq(10)
    for x in (big, small1, small2, small3):
        s.add(x)
    assert s.schedule().prefills == [big]  # over budget alone, still admitted
    prefilled(big)
    assert s.schedule().prefills == [small1, small2]


def test_a_full_queue_and_a_full_pool_refuse_a_new_sequence():
    s = scheduler(slots=1, max_waiting=1)
    s.add(seq(10))  # will take the free slot at the next step
    s.add(seq(10))  # waits: the queue has room for one
    with pytest.raises(QueueFullError, match="all 1 KV slots are in use"):
        s.add(seq(10))
    s.schedule()
    with pytest.raises(QueueFullError):
        s.add(seq(10))


def test_finishing_a_sequence_frees_its_slot_for_the_next():
    s = scheduler(slots=1, max_waiting=1)
    a, b = seq(10), seq(10)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(a)  # while it prefills
    assert a.status is SequenceStatus.FINISHED and s.slots.num_free == 1 and not s.running
    assert s.schedule().prefills == [b] and b.slot == 0


def test_a_waiting_sequence_can_be_finished_before_it_runs():
    s = scheduler(slots=1, max_waiting=2)
    a, b = seq(10), seq(10)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b)
    assert not s.waiting and s.slots.num_used == 1
