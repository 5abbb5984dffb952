"""The block manager: allocation, growth at block boundaries, freeing, shared prefixes with
reference counts and copy on write, and exhaustion that leaves the pool untouched."""

from __future__ import annotations

import pytest

from engine.sched.blocks import BlockCopy, BlockManager, NoFreeBlocksError


def test_a_prompt_takes_the_blocks_its_tokens_need():
    blocks = BlockManager(8, block_size=4)
    assert blocks.allocate("a", 9) == [0, 1, 2]
    assert blocks.num_free_blocks == 5 and blocks.num_tokens("a") == 9


def test_decode_takes_a_block_only_when_it_crosses_a_boundary():
    blocks = BlockManager(8, block_size=4)
    blocks.allocate("a", 3)
    assert blocks.append_slots("a") is None and blocks.block_table("a") == [0]
    blocks.append_slots("a")  # position 4 starts block 2
    assert blocks.block_table("a") == [0, 1] and blocks.num_tokens("a") == 5


def test_freed_blocks_are_reused_and_never_handed_out_twice():
    blocks = BlockManager(6, block_size=2)
    blocks.allocate("a", 4)
    blocks.allocate("b", 4)
    blocks.free("a")
    blocks.allocate("c", 6)
    in_use = blocks.block_table("b") + blocks.block_table("c")
    assert len(set(in_use)) == len(in_use) == 5 and blocks.num_free_blocks == 1


def test_a_sequence_takes_the_lowest_run_of_consecutive_free_blocks_where_there_is_one():
    pool = BlockManager(num_blocks=10, block_size=4)
    for seq, tokens in (("a", 12), ("b", 8), ("c", 12)):
        pool.allocate(seq, tokens)  # a: 0-2, b: 3-4, c: 5-7
    pool.free("a")
    pool.free("c")  # free: 0-2 and 5-9
    assert pool.allocate("d", 16) == [5, 6, 7, 8]  # one run, not 0-2 and 5
    assert pool.allocate("e", 16) == [0, 1, 2, 9]  # no run of four left: the lowest ids
    assert pool.num_free_blocks == 0


def test_exhaustion_raises_and_leaves_the_pool_as_it_was():
    blocks = BlockManager(3, block_size=4)
    blocks.allocate("a", 8)
    assert not blocks.can_allocate(5) and blocks.can_allocate(4)
    with pytest.raises(NoFreeBlocksError):
        blocks.allocate("b", 5)
    assert blocks.num_free_blocks == 1
    with pytest.raises(KeyError):
        blocks.block_table("b")
    blocks.append_slots("a", 4)
    with pytest.raises(NoFreeBlocksError):
        blocks.append_slots("a")
    assert blocks.num_tokens("a") == 12


def test_fork_shares_blocks_and_free_keeps_them_until_the_last_user_leaves():
    blocks = BlockManager(8, block_size=4)
    blocks.allocate("a", 8)
    assert blocks.fork("a", "b") == [0, 1]
    assert blocks.refcount(0) == blocks.refcount(1) == 2
    blocks.free("a")
    assert blocks.num_free_blocks == 6 and blocks.refcount(0) == 1
    blocks.free("b")
    assert blocks.num_free_blocks == 8


def test_writing_into_a_shared_partial_block_copies_it_first():
    blocks = BlockManager(8, block_size=4)
    blocks.allocate("a", 6)
    blocks.fork("a", "b")
    assert blocks.blocks_to_append("b") == 1
    assert blocks.append_slots("b") == BlockCopy(src=1, dst=2)
    assert blocks.block_table("b") == [0, 2] and blocks.refcount(1) == 1
    assert blocks.append_slots("a") is None  # a is the only user of block 1 now


def test_sharing_only_full_blocks_needs_no_copy():
    blocks = BlockManager(8, block_size=4)
    blocks.allocate("a", 10)
    assert blocks.fork("a", "b", num_tokens=8) == [0, 1]
    assert blocks.append_slots("b", 3) is None and blocks.block_table("b") == [0, 1, 3]


def test_misuse_is_refused_with_a_message():
    blocks = BlockManager(4, block_size=4)
    blocks.allocate("a", 4)
    with pytest.raises(ValueError, match="already"):
        blocks.allocate("a", 1)
    with pytest.raises(ValueError, match="share"):
        blocks.fork("a", "b", num_tokens=5)
    with pytest.raises(KeyError, match="no blocks"):
        blocks.free("zzz")
