"""The paged pool's size: the byte budget cut into blocks, capped where more could never be used,
refused where one sequence of max_model_len would not fit; and the lanes the estimate counts."""

from __future__ import annotations

import pytest

from engine.runner.model_runner import fit_blocks, pool_bytes
from engine.sched.blocks import BlockManager
from engine.sched.scheduler import Scheduler
from engine.sched.sequence import Sequence


def test_the_budget_is_cut_into_blocks_up_to_what_max_num_seqs_can_fill(engine_for):
    ops = engine_for("llama").ops
    block = pool_bytes(ops, 16)
    assert fit_blocks(ops, 4, 256, 16, 40 * block + block - 1) == 40  # 2.5 sequences of 256
    assert fit_blocks(ops, 4, 256, 16, 1000 * block) == 4 * 16  # no more than 4 x 256 positions
    assert fit_blocks(ops, 4, 250, 16, 1000 * block) == 4 * 16  # 250 positions take 16 blocks


def test_a_budget_below_one_sequence_of_max_model_len_is_refused(engine_for):
    ops = engine_for("llama").ops
    with pytest.raises(ValueError, match="holds no sequence of max_model_len 256"):
        fit_blocks(ops, 4, 256, 16, 15 * pool_bytes(ops, 16))


def test_startable_now_counts_the_waiting_that_fit_and_one_arrival_if_room_is_left():
    s: Scheduler[Sequence] = Scheduler(BlockManager(8, 16), 4, 8, 1000)
    assert s.startable_now() == 1
    for _ in range(3):
        s.add(Sequence(num_prompt_tokens=40, max_tokens=8))  # 3 blocks each
    assert s.num_admissible() == 2 and s.startable_now() == 2  # 2 fit; 2 blocks left, held up
    s.schedule()
    assert s.num_admissible() == 0 and s.startable_now() == 0  # the third needs 3 of the 2 left
