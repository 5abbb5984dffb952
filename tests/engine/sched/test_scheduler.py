"""The scheduler: admission by free KV blocks (prompt plus max_tokens) and lanes within a prefill
token budget, first come first served also while prefills are in flight; every step decodes
first and shares what its token budget leaves among the prefills in order, each at least the
floor; 429 only when queue and pool are full, blocks and lanes freed at once."""

from __future__ import annotations

import math

import pytest

from engine.errors import PromptTooLongError, QueueFullError
from engine.sched.blocks import BlockManager
from engine.sched.scheduler import MIN_PREFILL_TOKENS, Scheduler, Step
from engine.sched.sequence import Sequence, SequenceStatus

BLOCK = 16


def seq(prompt_tokens: int, max_tokens: int = 4) -> Sequence:
    return Sequence(num_prompt_tokens=prompt_tokens, max_tokens=max_tokens)


def scheduler(
    slots: int = 2,
    max_waiting: int = 1,
    budget: int = 100,
    step_tokens: int | None = 32,
    blocks: int | None = None,
    decode_weight: float = 1.0,
) -> Scheduler:
    """`slots` lanes (max_num_seqs) over a pool of `blocks` (default: 64 positions per lane)."""
    pool = BlockManager(blocks if blocks is not None else 4 * slots, BLOCK)
    return Scheduler(pool, slots, max_waiting, budget, step_tokens, decode_weight=decode_weight)


def prefilled(*seqs: Sequence) -> None:
    """What the executor does when a prefill completes: the prompt is cached."""
    for x in seqs:
        x.num_cached = x.num_prompt_tokens


def start_decoding(s: Scheduler, count: int) -> list[Sequence]:
    """`count` short sequences admitted and prefilled: they decode from the next step on."""
    decoding = [seq(10) for _ in range(count)]
    for x in decoding:
        s.add(x)
    s.schedule()
    prefilled(*decoding)
    return decoding


def test_the_lowest_free_lane_is_handed_out_first():
    s = scheduler(slots=3, max_waiting=3)
    a, b, c, d = seq(10), seq(10), seq(10), seq(10)
    for x in (a, b, c):
        s.add(x)
    s.schedule()
    assert (a.lane, b.lane, c.lane) == (0, 1, 2)
    prefilled(a, b, c)
    s.finish(b)
    s.add(d)
    s.schedule()
    assert d.lane == 1 and b.lane is None


def test_waiting_sequences_are_admitted_while_lanes_are_free():
    s = scheduler(slots=2, max_waiting=2)
    a, b, c = seq(10), seq(10), seq(10)
    for x in (a, b, c):
        s.add(x)
    step = s.schedule()
    assert step.prefills == [a, b] and not step.decodes and (a.lane, b.lane) == (0, 1)
    assert list(s.waiting) == [c] and c.status is SequenceStatus.WAITING


def test_admission_reserves_the_blocks_of_prompt_plus_max_tokens():
    s = scheduler(slots=8, max_waiting=8, budget=1000, blocks=10)
    a, b, c = seq(40, max_tokens=8), seq(60, max_tokens=20), seq(17, max_tokens=0)
    for x in (a, b, c):
        s.add(x)
    s.schedule()
    # 48, 80 and 17 positions: 3, 5 and 2 blocks, disjoint, and the pool is full.
    assert [len(x.block_table) for x in (a, b, c)] == [3, 5, 2]
    assert len({*a.block_table, *b.block_table, *c.block_table}) == 10
    assert s.blocks.num_free_blocks == 0


def test_admission_is_by_free_blocks_not_lanes():
    s = scheduler(slots=8, max_waiting=8, blocks=6)
    long, short, later = seq(60, max_tokens=20), seq(10), seq(10)  # 5, 1 and 1 blocks
    for x in (long, short, later):
        s.add(x)
    assert s.schedule().prefills == [long, short]  # lanes are free, blocks are not
    assert list(s.waiting) == [later] and later.lane is None and not later.block_table
    prefilled(long, short)
    s.finish(long)
    assert s.schedule().prefills == [later] and s.blocks.num_free_blocks == 4


def test_a_waiting_sequence_that_does_not_fit_is_not_overtaken():
    s = scheduler(slots=8, max_waiting=8, blocks=6)
    first, big, small = seq(40, max_tokens=8), seq(60, max_tokens=4), seq(10)  # 3, 4, 1 blocks
    for x in (first, big, small):
        s.add(x)
    assert s.schedule().prefills == [first]
    prefilled(first)
    assert not s.schedule().prefills and list(s.waiting) == [big, small]


def test_a_sequence_longer_than_the_whole_pool_is_refused():
    s = scheduler(slots=2, max_waiting=2, blocks=4)
    with pytest.raises(PromptTooLongError, match="more than the KV pool's 4 blocks"):
        s.add(seq(60, max_tokens=5))  # 65 positions: 5 blocks
    s.add(seq(60, max_tokens=4))  # 64: the whole pool
    assert len(s.waiting) == 1


def test_with_nothing_decoding_the_prefills_of_a_step_run_whole():
    s = scheduler(slots=2, max_waiting=2, step_tokens=32)
    s.add(seq(40))
    assert s.schedule().prefill_tokens == [math.inf]


def one_decodes_while_one_arrives(s: Scheduler) -> tuple[Sequence, Sequence, Step]:
    """`a` prefilled and decoding, `b` just admitted: the step that runs both."""
    a, b = seq(10), seq(10)
    s.add(a)
    s.schedule()
    prefilled(a)
    s.add(b)
    return a, b, s.schedule()


def test_every_step_decodes_the_cached_sequences_and_prefills_in_the_tokens_they_leave():
    s = scheduler(slots=3, max_waiting=3, step_tokens=32)
    a, b, step = one_decodes_while_one_arrives(s)
    assert step.decodes == [a] and step.prefills == [b] and step.prefill_tokens == [10]
    assert s.schedule().decodes == [a]  # b is still prefilling: it does not decode yet
    prefilled(b)
    step = s.schedule()
    assert step.decodes == [a, b] and not step.prefills


def test_a_short_request_arriving_during_a_long_prefill_starts_at_the_next_step():
    s = scheduler(slots=4, max_waiting=4, step_tokens=32, blocks=64)
    a, long, short = seq(10), seq(600), seq(20)
    s.add(a)
    s.schedule()
    prefilled(a)  # decoding from now on: steps are bounded
    s.add(long)
    step = s.schedule()
    assert step.prefills == [long] and step.prefill_tokens == [31]  # all the decode leaves
    s.add(short)  # arrives while the long prompt prefills
    step = s.schedule()
    assert step.prefills == [long, short] and short.lane is not None
    # The long prompt leaves the arrival its floor.
    assert step.prefill_tokens == [31 - MIN_PREFILL_TOKENS, MIN_PREFILL_TOKENS]
    assert step.num_waiting == 0


def test_under_decodes_that_fill_the_budget_the_prefill_in_flight_gets_its_floor_each_step():
    s = scheduler(slots=12, max_waiting=12, step_tokens=8, blocks=96)
    running = [seq(10) for _ in range(8)]
    for x in running:
        s.add(x)
    s.schedule()
    prefilled(*running)
    late = [seq(3 * MIN_PREFILL_TOKENS) for _ in range(3)]
    for x in late:
        s.add(x)
    for first in (0, 0, 0, 1, 1, 1, 2, 2, 2):
        step = s.schedule()
        # 8 decodes take the whole budget: the prefill in flight gets its floor every step,
        # and the next one is admitted once it completes (the budget has nothing left).
        assert len(step.decodes) == 8 and step.prefills == late[first : first + 1]
        assert step.prefill_tokens == [MIN_PREFILL_TOKENS]
        x = step.prefills[0]
        x.num_prefilled += MIN_PREFILL_TOKENS
        if x.num_prefilled >= x.num_prompt_tokens:
            prefilled(x)
            s.finish(x)


@pytest.mark.parametrize(
    ("decode_weight", "prefill_tokens"),
    [(1.0, 36), (2.5, 30), (10.0, MIN_PREFILL_TOKENS)],  # 40 less 4 decodes, at least the floor
)
def test_each_decoding_sequence_takes_its_weight_of_the_step_budget(decode_weight, prefill_tokens):
    s = scheduler(slots=8, max_waiting=8, step_tokens=40, blocks=64, decode_weight=decode_weight)
    start_decoding(s, 4)
    s.add(seq(200))
    step = s.schedule()
    assert len(step.decodes) == 4 and step.prefill_tokens == [prefill_tokens]
    assert step.budget(4) == 40 - 4 * decode_weight


def test_a_decode_weight_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="decode_weight"):
        scheduler(decode_weight=0)


def test_background_work_gets_what_the_step_leaves_and_at_least_the_floor():
    s = scheduler(slots=4, max_waiting=4, step_tokens=64, blocks=64)
    start_decoding(s, 3)
    s.add(seq(20))
    step = s.schedule()
    # 3 decodes and the 20 prompt tokens the new prefill needs leave 41 of the 64.
    assert step.prefill_tokens == [20] and step.background_tokens == 64 - 3 - 20
    step.prefills[0].num_prefilled = 20
    prefilled(step.prefills[0])
    assert s.schedule().background_tokens == 64 - 4
    full = scheduler(slots=4, max_waiting=4, step_tokens=4, blocks=64)
    for x in [seq(10) for _ in range(4)]:
        full.add(x)
        full.schedule()
        prefilled(x)
    assert full.schedule().background_tokens == MIN_PREFILL_TOKENS  # decodes fill the budget


def test_a_prefill_in_flight_is_given_no_more_than_it_still_needs():
    s = scheduler(slots=3, max_waiting=3, budget=1000, step_tokens=200, blocks=64)
    a, b, c = seq(10), seq(120), seq(150)
    s.add(a)
    s.schedule()
    prefilled(a)
    s.add(b)
    s.add(c)
    step = s.schedule()
    assert step.prefills == [b, c] and step.prefill_tokens == [120, 79]
    b.num_prefilled, c.num_prefilled = 120, 79
    assert s.schedule().prefill_tokens == [1, 71]  # b's last rows (an upper bound), c the rest


def test_without_a_token_budget_prefills_run_whole_beside_the_decodes():
    s = scheduler(slots=3, max_waiting=3, step_tokens=None)
    a, b, step = one_decodes_while_one_arrives(s)
    assert step.decodes == [a] and step.prefills == [b] and step.prefill_tokens == [math.inf]


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
    s.add(seq(10))  # will take the free lane at the next step
    s.add(seq(10))  # waits: the queue has room for one
    full = r"2 requests wait and the KV pool \(4 of 4 blocks free, 1 of 1 sequences\)"
    with pytest.raises(QueueFullError, match=full):
        s.add(seq(10))
    s.schedule()
    with pytest.raises(QueueFullError):
        s.add(seq(10))


def test_a_full_pool_of_blocks_with_free_lanes_refuses_beyond_the_queue():
    s = scheduler(slots=4, max_waiting=1, blocks=4)
    s.add(seq(60, max_tokens=4))  # the whole pool
    s.add(seq(10))  # waits: the queue has room for one
    s.schedule()  # the first takes every block; three lanes stay free
    with pytest.raises(QueueFullError, match="0 of 4 blocks free, 3 of 4 sequences"):
        s.add(seq(10))


def test_finishing_a_sequence_frees_its_blocks_and_lane_for_the_next():
    s = scheduler(slots=1, max_waiting=1)
    a, b = seq(10), seq(10)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(a)  # while it prefills
    assert a.status is SequenceStatus.FINISHED and s.blocks.num_free_blocks == 4
    assert not s.running and a.lane is None and not a.block_table
    assert s.schedule().prefills == [b] and b.lane == 0


def test_a_waiting_sequence_can_be_finished_before_it_runs():
    s = scheduler(slots=1, max_waiting=2)
    a, b = seq(10), seq(10)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b)
    assert not s.waiting and s.blocks.num_free_blocks == 3
