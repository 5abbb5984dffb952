"""The scheduler and the slot table: admission by free KV slots and a prefill token budget,
decodes between prefills, 429 only when queue and pool are full, slots freed at once."""

from __future__ import annotations

import pytest

from engine.errors import QueueFullError
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.slots import SlotTable


def seq(prompt_tokens: int, max_tokens: int = 4) -> Sequence:
    return Sequence(num_prompt_tokens=prompt_tokens, max_tokens=max_tokens)


def scheduler(slots: int = 2, max_waiting: int = 1, budget: int = 100) -> Scheduler:
    return Scheduler(SlotTable(slots, 64), max_waiting, budget)


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
    batch, is_prefill = s.schedule()
    assert is_prefill and batch == [a, b] and (a.slot, b.slot) == (0, 1)
    assert list(s.waiting) == [c] and c.status is SequenceStatus.WAITING


def test_a_prefill_step_is_followed_by_a_decode_step_of_every_running_sequence():
    s = scheduler(slots=3, max_waiting=3)
    a, b = seq(10), seq(10)
    s.add(a)
    assert s.schedule() == ([a], True)
    s.add(b)
    assert s.schedule() == ([a], False)  # a decodes before b is prefilled
    assert s.schedule() == ([b], True)
    assert s.schedule() == ([a, b], False)


def test_the_prefill_token_budget_bounds_a_step_but_always_admits_one():
    s = scheduler(slots=4, max_waiting=4, budget=25)
    big, small1, small2, small3 = seq(40), seq(10), seq(10), seq(10)
    for x in (big, small1, small2, small3):
        s.add(x)
    assert s.schedule() == ([big], True)  # over budget alone, still admitted
    s.schedule()  # decode
    assert s.schedule() == ([small1, small2], True)


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
    s.finish(a)
    assert a.status is SequenceStatus.FINISHED and s.slots.num_free == 1
    assert s.schedule() == ([b], True) and b.slot == 0


def test_a_waiting_sequence_can_be_finished_before_it_runs():
    s = scheduler(slots=1, max_waiting=2)
    a, b = seq(10), seq(10)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b)
    assert not s.waiting and s.slots.num_used == 1
