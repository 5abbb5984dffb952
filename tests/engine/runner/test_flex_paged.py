"""Flex decode attention over the pool in place: each row's block mask lists exactly its own
blocks, its mask_mod keeps its positions (ragged last block, sliding window), the attention
equals SDPA over the row's own keys, padding rows read the scratch block only; and the choice of
path, by the runner and the engine option."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.engine import Engine
from engine.model.paged_attention import token_rows
from engine.runner.flex_paged import FlexPaged, check_block_size, padded_batch
from engine.runner.model_runner import ModelRunner

# flex's eager reference on the CPU is the point here (exact, not fast); torch warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

SIZE, POOL, H_KV, GROUP, DIM = 4, 24, 2, 3, 8
SCRATCH = POOL  # the pool's last block, [POOL + 1] in all
# Ragged: 18 positions end two into their fifth block; 5 fill one block and one position; 8
# fill two blocks exactly. Blocks out of order, and the table of row 1 padded with the scratch.
TABLES = [[7, 2, 19, 11, 4, 5], [13, 3, SCRATCH, SCRATCH, SCRATCH, SCRATCH], [0, 22, 9, 1, 8, 6]]
POSITIONS = [17, 4, 7]
SCALE = 0.3


def masks(window: int | None, compiled: bool = False):
    flex = FlexPaged(SIZE, SCRATCH, GROUP, compiled)
    return flex.masks(torch.tensor(TABLES), torch.tensor(POSITIONS), {window})[window]


def own_positions(b: int, window: int | None) -> range:
    return range(0 if window is None else max(0, POSITIONS[b] - window + 1), POSITIONS[b] + 1)


def own_rows(b: int, window: int | None) -> torch.Tensor:
    """Rows of the pool flattened to [(POOL + 1) * SIZE, H_kv, D] that row b attends to."""
    positions = torch.tensor(own_positions(b, window))
    return token_rows(torch.tensor(TABLES[b]), positions, SIZE)


@pytest.mark.parametrize("window", [None, 7])
def test_the_block_mask_lists_exactly_each_rows_own_blocks(window):
    mask = masks(window)
    for b, table in enumerate(TABLES):
        blocks = list(dict.fromkeys(table[p // SIZE] for p in own_positions(b, window)))
        count = int(mask.kv_num_blocks[b, 0, 0])
        assert mask.kv_indices[b, 0, 0, :count].tolist() == blocks
        listed = mask.to_dense()[b, 0, 0].nonzero().flatten().tolist()
        assert listed == sorted(blocks)  # no block of another row, nor the scratch
    if window is not None:  # windows start mid-block; row 0 leaves its first two blocks unread
        assert mask.kv_num_blocks.flatten().tolist() == [3, 2, 2]


@pytest.mark.parametrize("window", [None, 7])
def test_the_mask_keeps_each_rows_positions_only(window):
    mask = masks(window)
    keys = torch.arange((POOL + 1) * SIZE)
    zero = torch.tensor(0)
    for b in range(len(TABLES)):
        visible = mask.mask_mod(torch.tensor(b), zero, zero, keys)
        # Past a ragged row's last position and before its window, within its own blocks,
        # nothing is visible.
        assert visible.nonzero().flatten().tolist() == sorted(own_rows(b, window).tolist())


@pytest.mark.parametrize("window", [None, 7])
def test_flex_attention_equals_sdpa_over_each_rows_own_keys(window):
    generator = torch.Generator().manual_seed(0)
    shape = (POOL + 1, SIZE, H_KV, DIM)
    keys, values = (torch.randn(shape, generator=generator) for _ in range(2))
    q_rows = torch.randn(len(TABLES), H_KV, GROUP, DIM, generator=generator)
    flex = FlexPaged(SIZE, SCRATCH, GROUP, compiled=False)
    with torch.inference_mode():
        out = flex.attend(q_rows, keys, values, masks(window), SCALE)
    for b in range(len(TABLES)):
        rows = own_rows(b, window)
        k = keys.flatten(0, 1)[rows].transpose(0, 1)[None]
        v = values.flatten(0, 1)[rows].transpose(0, 1)[None]
        want = F.scaled_dot_product_attention(q_rows[b : b + 1], k, v, scale=SCALE)[0]
        torch.testing.assert_close(out[b], want, rtol=1e-5, atol=1e-6)


def test_a_compiled_step_pads_its_rows_to_the_bucket_with_the_scratch_block():
    padded = masks(None, compiled=True)
    assert padded.kv_num_blocks.shape[0] == padded_batch(len(TABLES)) == 4
    assert padded.kv_num_blocks[3].item() == 1 and padded.kv_indices[3, 0, 0, 0] == SCRATCH
    zero = torch.tensor(0)
    visible = padded.mask_mod(torch.tensor(3), zero, zero, torch.arange((POOL + 1) * SIZE))
    assert visible.nonzero().flatten().tolist() == [SCRATCH * SIZE]  # its own key only
    # The padded rows' outputs are dropped: the real rows' equal the unpadded step's.
    generator = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(POOL + 1, SIZE, H_KV, DIM, generator=generator) for _ in range(2))
    q_rows = torch.randn(len(TABLES), H_KV, GROUP, DIM, generator=generator)
    eager = FlexPaged(SIZE, SCRATCH, GROUP, compiled=False)
    with torch.inference_mode():
        got = eager.attend(q_rows, keys, values, padded, SCALE)
        want = eager.attend(q_rows, keys, values, masks(None), SCALE)
    torch.testing.assert_close(got, want)


def test_batch_buckets_then_multiples_of_the_largest():
    assert [padded_batch(n) for n in (1, 3, 16, 17, 64, 65, 130)] == [1, 4, 16, 32, 64, 128, 192]


def test_block_sizes_the_cuda_kernels_cannot_step_through_are_refused():
    for size in (4, 8, 24):
        with pytest.raises(ValueError, match=f"power of two of 16 or more, the pool's is {size}"):
            check_block_size(size, torch.device("cuda"))
    check_block_size(16, torch.device("cuda"))
    check_block_size(4, torch.device("cpu"))


def test_the_runner_takes_each_path_by_name_and_refuses_others(engine_for):
    runner = ModelRunner(engine_for("llama").ops, 8, SIZE, 16, num_lanes=1)
    assert runner.attention_path == "per_row" and runner.per_row  # the CPU's default
    runner.use_attention("flex")
    assert runner.attention_path == "flex" and not runner.per_row
    runner.use_attention("auto")
    assert runner.attention_path == "per_row"
    runner.use_attention("batched")
    assert runner.attention_path == "batched" and not runner.per_row
    with pytest.raises(ValueError, match="one of auto, per_row, batched, flex, got 'paged'"):
        runner.use_attention("paged")


def test_the_engine_option_reaches_the_runner(checkpoint_dir):
    engine = Engine.from_pretrained(checkpoint_dir("llama"), decode_attention="flex")
    try:
        assert engine.runner.attention_path == "flex"
    finally:
        engine.close()
    with pytest.raises(ValueError, match="decode attention must be one of"):
        Engine.from_pretrained(checkpoint_dir("llama"), decode_attention="gathered")
