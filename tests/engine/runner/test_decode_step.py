"""Decode steps padded to buckets: the bucket a step pads to, padding rows confined to the
scratch block, and (with a GPU) the CUDA-graph replay equal to the eager step."""

from __future__ import annotations

import pytest
import torch

from engine.blend.dense import run_to_end
from engine.blend.prefill import PrefillAsk
from engine.runner.decode_step import BATCH_BUCKETS, bucket, build_step
from engine.runner.model_runner import ModelRunner
from engine.types import GenerateRequest, Mode


def test_a_step_pads_to_the_next_batch_bucket_and_power_of_two_blocks():
    assert bucket(3, 5, 512) == (4, 8)
    assert bucket(16, 16, 512) == (16, 16)
    assert bucket(17, 300, 256) == (32, 256)  # at most the blocks of max_model_len
    assert bucket(BATCH_BUCKETS[-1] + 1, 4, 512) is None  # past the buckets: eager


def test_padding_rows_read_and_write_the_scratch_block_only():
    step = build_step(
        [[3, 4], [7]],
        [20, 5],
        [11, 12],
        block_size=16,
        scratch=9,
        windows={None, 8},
        device=torch.device("cpu"),
        shape=(4, 4),
    )
    assert step.table.tolist() == [[3, 4, 9, 9], [7, 9, 9, 9], [9, 9, 9, 9], [9, 9, 9, 9]]
    assert step.new_rows.tolist() == [4 * 16 + 4, 7 * 16 + 5, 9 * 16, 9 * 16]
    assert step.token_ids.tolist() == [11, 12, 0, 0] and step.pos.tolist() == [20, 5, 0, 0]
    causal, window = step.masks[None][:, 0, 0], step.masks[8][:, 0, 0]
    assert causal.sum(1).tolist() == [21, 6, 1, 1]  # a padding row sees its own key only
    assert window.sum(1).tolist() == [8, 6, 1, 1]
    assert window[0].nonzero().flatten().tolist() == list(range(13, 21))


def test_cuda_graphs_on_the_cpu_are_refused_naming_the_device(checkpoint_dir):
    from engine.engine import Engine

    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Engine.from_pretrained(checkpoint_dir("llama"), cuda_graph_max_batch=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decode_equals_the_eager_decode(checkpoint_dir):
    from engine.engine import Engine

    engine = Engine.from_pretrained(checkpoint_dir("llama"), device="cuda", max_num_seqs=1)
    try:
        req = GenerateRequest(question="which tas does kalo hold?", chunks=(), max_tokens=8)
        prefill = run_to_end(
            engine.prefiller.prefill(engine.layout(req), PrefillAsk(Mode.FULL_PREFILL))
        )
        keys, values = prefill.output.keys, prefill.output.values
        n = keys.shape[2]
        runners = [ModelRunner(engine.ops, 64, 16, 1024, num_lanes=1) for _ in range(2)]
        runners[1].use_cuda_graphs(max_batch=8)
        tables = [list(range(0, 20)), list(range(20, 40)), list(range(40, 60))]
        for runner in runners:
            for table in tables:
                runner.write_prompt(table, keys, values)
        tokens, positions = [1, 2, 3], [n, n, n]
        for _ in range(4):  # the first step captures, the rest replay
            eager, graphed = (r.decode(tables, positions, tokens) for r in runners)
            torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-5)
            tokens = eager.argmax(-1).tolist()
            positions = [p + 1 for p in positions]
        assert len(runners[1].graphs.graphs) == 1  # type: ignore[union-attr]
    finally:
        engine.close()
