"""Prompt prefixes held once in the KV pool: the registry's references to full blocks, admission
that forks them and counts only the rest, reclaim of idle entries under pressure, and the
scheduler's counts agreeing with what it admits."""

from __future__ import annotations

import random

from engine.sched.blocks import BlockManager
from engine.sched.scheduler import Scheduler
from engine.sched.sequence import Sequence
from engine.sched.shared_prefix import SharedPrefixes

BLOCK = 4
PREFIX = tuple(range(100, 110))  # 10 tokens: two full blocks and a partial one
OTHER = tuple(range(200, 209))  # 9 tokens: two full blocks


def registered(blocks: BlockManager, prefixes: SharedPrefixes, seq_id: int, prefix, n: int):
    """A sequence of `n` positions whose prefill completed, its prefix registered."""
    prefixes.allocate(seq_id, prefix, n)
    prefixes.register(seq_id, prefix)
    return blocks.block_table(seq_id)


def test_a_registered_prefix_holds_its_full_blocks_only():
    blocks = BlockManager(16, BLOCK)
    prefixes = SharedPrefixes(blocks, capacity=4)
    table = registered(blocks, prefixes, 1, PREFIX, 14)
    assert [blocks.refcount(b) for b in table] == [2, 2, 1, 1]  # the partial third: its own
    assert prefixes.shared_blocks(PREFIX) == prefixes.num_blocks == 2
    registered(blocks, prefixes, 2, PREFIX[:3], 6)  # shorter than a block: nothing to share
    assert prefixes.shared_blocks(PREFIX[:3]) == 0 and prefixes.num_blocks == 2


def test_admission_forks_the_prefix_blocks_and_takes_only_the_rest():
    blocks = BlockManager(16, BLOCK)
    prefixes = SharedPrefixes(blocks, capacity=4)
    first = registered(blocks, prefixes, 1, PREFIX, 14)
    free = blocks.num_free_blocks
    assert prefixes.allocate(2, PREFIX, 20) == 8  # the shared positions
    second = blocks.block_table(2)
    assert second[:2] == first[:2] and not set(second[2:]) & set(first)
    assert blocks.num_free_blocks == free - (blocks.blocks_for(20) - 2)
    assert [blocks.refcount(b) for b in first[:2]] == [3, 3]


def test_finished_sequences_leave_the_prefix_to_the_registry_until_it_is_reclaimed():
    blocks = BlockManager(16, BLOCK)
    prefixes = SharedPrefixes(blocks, capacity=4)
    table = registered(blocks, prefixes, 1, PREFIX, 14)
    prefixes.allocate(2, PREFIX, 20)
    blocks.free(1)
    prefixes.reclaim(16)
    assert prefixes.num_blocks == 2, "sequence 2 still shares it: not given back"
    blocks.free(2)
    assert [blocks.refcount(b) for b in table[:2]] == [1, 1] and blocks.num_free_blocks == 14
    prefixes.reclaim(16)
    assert prefixes.num_blocks == 0 and blocks.num_free_blocks == 16


def test_reclaim_gives_back_idle_entries_least_recently_used_first_and_only_as_needed():
    blocks = BlockManager(16, BLOCK)
    prefixes = SharedPrefixes(blocks, capacity=4)
    registered(blocks, prefixes, 1, PREFIX, 12)
    registered(blocks, prefixes, 2, OTHER, 12)
    blocks.free(1), blocks.free(2)
    prefixes.allocate(3, PREFIX, 8)  # PREFIX used last
    blocks.free(3)
    assert blocks.num_free_blocks == 12
    prefixes.reclaim(13)
    assert prefixes.shared_blocks(OTHER) == 0 and prefixes.shared_blocks(PREFIX) == 2
    assert blocks.num_free_blocks == 14
    prefixes.reclaim(16, keep=PREFIX)
    assert prefixes.shared_blocks(PREFIX) == 2


def test_the_registry_keeps_at_most_capacity_prefixes():
    blocks = BlockManager(16, BLOCK)
    prefixes = SharedPrefixes(blocks, capacity=1)
    registered(blocks, prefixes, 1, PREFIX, 12)
    registered(blocks, prefixes, 2, OTHER, 12)
    assert prefixes.shared_blocks(PREFIX) == 0 and prefixes.shared_blocks(OTHER) == 2
    none = SharedPrefixes(BlockManager(16, BLOCK), capacity=0)
    registered(none.blocks, none, 1, PREFIX, 12)
    assert none.num_blocks == 0


def test_over_capacity_the_least_recently_used_idle_prefix_goes_before_a_shared_one():
    blocks = BlockManager(32, BLOCK)
    prefixes = SharedPrefixes(blocks, capacity=2)
    third = tuple(range(300, 308))
    registered(blocks, prefixes, 1, PREFIX, 12)  # sequence 1 still runs: PREFIX is shared
    registered(blocks, prefixes, 2, OTHER, 12)
    blocks.free(2)  # OTHER idle, though used after PREFIX
    registered(blocks, prefixes, 3, third, 12)
    assert prefixes.shared_blocks(PREFIX) == 2 and prefixes.shared_blocks(OTHER) == 0
    assert prefixes.shared_blocks(third) == 2 and prefixes.num_blocks == 4
    # Every entry shared: the least recently used goes, its blocks left to its sequence.
    registered(blocks, prefixes, 4, OTHER, 12)
    assert prefixes.shared_blocks(PREFIX) == 0 and prefixes.num_blocks == 4
    assert [blocks.refcount(b) for b in blocks.block_table(1)[:2]] == [1, 1]


def seq(prompt: int, prefix: tuple[int, ...] = PREFIX, max_tokens: int = 4) -> Sequence:
    return Sequence(num_prompt_tokens=prompt, max_tokens=max_tokens, shared_prefix=prefix)


def cached(s: Scheduler, *seqs: Sequence) -> None:
    """Their prefills complete; the next schedule() registers their prefixes."""
    for x in seqs:
        x.num_cached = x.num_prompt_tokens
    s.schedule()


def test_the_scheduler_admits_a_sequence_with_a_registered_prefix_on_its_blocks():
    s: Scheduler[Sequence] = Scheduler(BlockManager(16, BLOCK), 4, 8, 1000, shared_prefixes=4)
    a = seq(14)
    s.add(a)
    s.schedule()
    assert a.num_shared_tokens == 0
    cached(s, a)
    b, full = seq(14), seq(14, prefix=())  # the second as a full prefill would be: no prefix
    s.add(b), s.add(full)
    s.schedule()
    assert b.num_shared_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert full.num_shared_tokens == 0 and not set(full.block_table) & set(a.block_table)
    shared = a.block_table[:2]
    assert [s.blocks.refcount(x) for x in shared] == [3, 3]
    s.finish(a), s.finish(b)
    assert [s.blocks.refcount(x) for x in shared] == [1, 1] and s.prefixes.num_blocks == 2


def test_a_sequence_fits_where_only_its_unshared_blocks_are_free():
    s: Scheduler[Sequence] = Scheduler(BlockManager(8, BLOCK), 4, 8, 1000, shared_prefixes=4)
    a = seq(14, max_tokens=2)  # 4 blocks
    s.add(a)
    s.schedule()
    cached(s, a)
    b, c = seq(14, max_tokens=2), seq(14, max_tokens=2)  # 2 blocks each beyond the prefix
    s.add(b), s.add(c)
    assert s.num_admissible() == 2 and s.startable_now() == 2
    s.schedule()
    assert len(s.running) == 3 and s.blocks.num_free_blocks == 0


def test_a_prefix_cached_in_the_last_step_counts_for_admission_before_the_next_schedule():
    s: Scheduler[Sequence] = Scheduler(BlockManager(8, BLOCK), 4, 8, 1000, shared_prefixes=4)
    a = seq(14, max_tokens=2)
    s.add(a)
    s.schedule()
    a.num_cached = a.num_prompt_tokens  # the step completed its prefill
    assert s.finish_done([a]) == []
    assert s.decoding == [a] and s.prefixes.shared_blocks(PREFIX) == 2
    b, c = seq(14, max_tokens=2), seq(14, max_tokens=2)
    s.add(b), s.add(c)
    assert s.num_admissible() == 2 and s.startable_now() == 2


def test_idle_prefixes_are_given_back_when_the_next_sequence_does_not_fit():
    s: Scheduler[Sequence] = Scheduler(BlockManager(8, BLOCK), 4, 8, 1000, shared_prefixes=4)
    a = seq(14, max_tokens=2)
    s.add(a)
    s.schedule()
    cached(s, a)
    s.finish(a)
    assert s.prefixes.num_blocks == 2 and s.blocks.num_free_blocks == 6
    big = seq(30, prefix=OTHER, max_tokens=2)  # all 8 blocks
    s.add(big)
    assert s.num_admissible() == 1
    s.schedule()
    assert big in s.running and s.prefixes.num_blocks == 0


def test_a_sequence_that_finishes_as_its_prefill_completes_leaves_its_prefix_registered():
    s: Scheduler[Sequence] = Scheduler(BlockManager(16, BLOCK), 4, 8, 1000, shared_prefixes=4)
    a = seq(14, max_tokens=1)
    s.add(a)
    s.schedule()
    a.num_cached = a.num_prompt_tokens  # its prefill completed and gave its only token
    prefix_blocks = a.block_table[:2]
    s.finish(a)
    assert s.prefixes.shared_blocks(PREFIX) == 2 and s.blocks.num_free_blocks == 14
    b = seq(14)
    s.add(b)
    s.schedule()
    assert b.num_shared_tokens == 8 and b.block_table[:2] == prefix_blocks
    paused = seq(14, prefix=OTHER)  # cancelled before its prefill completed: nothing cached
    s.add(paused)
    cached(s, b)
    assert paused in s.prefilling
    s.finish(paused)
    assert s.prefixes.shared_blocks(OTHER) == 0


def test_the_counts_of_admissible_sequences_match_what_is_admitted():
    """Random pools of running, finished and registered sequences (some finished in the step
    their prefill completed): `num_admissible` predicts exactly what the next schedule()
    admits, reclaim and sharing included."""
    prefixes = [PREFIX, OTHER, tuple(range(300, 317)), ()]
    for trial in range(200):
        rng = random.Random(trial)
        s: Scheduler[Sequence] = Scheduler(
            BlockManager(rng.randint(12, 40), BLOCK), 6, 64, 10_000, shared_prefixes=2
        )
        for _ in range(rng.randint(1, 4)):
            for _ in range(rng.randint(1, 3)):
                s.add(seq(rng.randint(18, 40), rng.choice(prefixes), rng.randint(1, 8)))
            s.schedule()
            cached(s, *s.prefilling)
            for x in s.prefilling:  # completed in this step, finished or not
                if rng.random() < 0.5:
                    x.num_cached = x.num_prompt_tokens
            for x in list(s.running):
                if rng.random() < 0.5:
                    s.finish(x)
        while s.prefilling:
            cached(s, *s.prefilling)
        for _ in range(rng.randint(1, 5)):
            s.waiting.append(seq(rng.randint(18, 40), rng.choice(prefixes), rng.randint(1, 8)))
        expected = s.num_admissible()
        assert len(s.schedule().prefills) == expected, trial


def test_a_prefix_given_back_for_one_sequence_is_not_counted_as_shared_for_the_next():
    s: Scheduler[Sequence] = Scheduler(BlockManager(12, BLOCK), 4, 8, 1000, shared_prefixes=4)
    for prefix in (PREFIX, OTHER):  # both registered, then idle: PREFIX used least recently
        x = seq(14, prefix, max_tokens=2)
        s.add(x)
        s.schedule()
        cached(s, x)
        s.finish(x)
    assert s.prefixes.num_blocks == 4 and s.blocks.num_free_blocks == 8
    big, behind = seq(38, prefix=(), max_tokens=2), seq(14, max_tokens=2)  # 10 blocks; 4 or 2
    s.add(big), s.add(behind)
    assert s.num_admissible() == 1  # big takes PREFIX's blocks: behind would need 4, not 2
    s.schedule()
    assert s.running == [big] and s.prefixes.shared_blocks(PREFIX) == 0


def test_a_prefix_is_shared_only_under_the_cache_salt_it_was_registered_with():
    blocks = BlockManager(16, BLOCK)
    prefixes = SharedPrefixes(blocks, capacity=4)
    prefixes.allocate(1, PREFIX, 14, "tenant-a")
    prefixes.register(1, PREFIX, "tenant-a")
    assert prefixes.shared_blocks(PREFIX, "tenant-a") == 2
    assert prefixes.shared_blocks(PREFIX, "tenant-b") == prefixes.shared_blocks(PREFIX) == 0
    assert prefixes.allocate(2, PREFIX, 14, "tenant-b") == 0  # its own blocks, none forked
    assert prefixes.allocate(3, PREFIX, 14, "tenant-a") == 8


def test_the_scheduler_shares_a_prefix_between_sequences_of_one_salt_only():
    s: Scheduler[Sequence] = Scheduler(BlockManager(16, BLOCK), 4, 8, 1000, shared_prefixes=4)
    first = Sequence(num_prompt_tokens=14, max_tokens=4, shared_prefix=PREFIX, prefix_salt="a")
    s.add(first)
    s.schedule()
    cached(s, first)
    other = Sequence(num_prompt_tokens=14, max_tokens=4, shared_prefix=PREFIX, prefix_salt="b")
    same = Sequence(num_prompt_tokens=14, max_tokens=4, shared_prefix=PREFIX, prefix_salt="a")
    s.add(other), s.add(same)
    s.schedule()
    assert other.num_shared_tokens == 0 and not set(other.block_table) & set(first.block_table)
    assert same.num_shared_tokens == 8 and same.block_table[:2] == first.block_table[:2]
