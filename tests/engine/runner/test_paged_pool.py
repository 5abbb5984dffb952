"""The paged pool's size: the byte budget cut into blocks, capped where more could never be used,
refused where one sequence of max_model_len would not fit; on the CPU taking RAM only as its blocks
come into use; and the lanes the estimate counts."""

from __future__ import annotations

import pytest

from engine.runner.model_runner import ModelRunner, fit_blocks, pool_bytes
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


def resident_mib() -> int:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) // 1024


def test_a_cpu_pool_takes_ram_as_its_blocks_are_written_and_reads_zeros(engine_for):
    ops = engine_for("llama").ops
    num_blocks = (512 << 20) // pool_bytes(ops, 16)  # 512 MiB of keys and as much of values
    before = resident_mib()
    runner = ModelRunner(ops, num_blocks, 16, 256, 4)
    assert resident_mib() - before < 64
    runner.keys[:, :8] = 1.0  # the first blocks, as the block manager hands them out
    assert resident_mib() - before < 128
    assert runner.keys[:, 8:16].abs().sum() == 0 and runner.values[:, :16].abs().sum() == 0
    assert runner.keys[:, :8].eq(1.0).all()


def test_startable_now_counts_the_waiting_that_fit_and_one_arrival_if_room_is_left():
    s: Scheduler[Sequence] = Scheduler(BlockManager(8, 16), 4, 8, 1000)
    assert s.startable_now() == 1
    for _ in range(3):
        s.add(Sequence(num_prompt_tokens=40, max_tokens=8))  # 3 blocks each
    assert s.num_admissible() == 2 and s.startable_now() == 2  # 2 fit; 2 blocks left, held up
    s.schedule()
    assert s.num_admissible() == 0 and s.startable_now() == 0  # the third needs 3 of the 2 left
