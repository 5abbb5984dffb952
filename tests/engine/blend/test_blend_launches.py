"""The blend loop's host cost does not grow with the chunks: its kernel-like operations per layer
(bench/op_count.py, the launch proxy) stay within 1.5x a full prefill's and within 10 % from 4
to 16 chunks, and it reads back from the device once per check layer, on the direct path and
served through the scheduler with each layer's KV staged as on a GPU."""

from __future__ import annotations

import sys
import threading

import pytest

from demo.tiny import save_random_checkpoint
from engine.blend.dense import run_to_end
from engine.blend.layout import PromptLayout
from engine.blend.prefill import PrefillAsk
from engine.engine import Engine
from engine.model.load import load_model
from engine.types import GenerateRequest, Mode
from kvstore.store import KVStore, KVStoreConfig
from tests.service_process import REPO_ROOT

# bench/ is no installed package: its counter is imported from the checkout.
sys.path.insert(0, str(REPO_ROOT))
from bench.op_count import OpCount, counting  # noqa: E402

CASES = [(Mode.FULL_PREFILL, None), (Mode.FULL_REUSE, None), (Mode.CACHEBLEND, 0.15)]


# Deep enough that the per-prefill work (embedding, the checks' selections, the logits)
# weighs per layer about as on a real model; the default check layers of 16: 1 and 4.
NUM_LAYERS = 16


@pytest.fixture(scope="module")
def staged_engine(tmp_path_factory):
    """A tiny 16-layer Llama whose store stages every layer's chunk KV as a GPU's does."""
    path = tmp_path_factory.mktemp("ckpt-llama-16")
    save_random_checkpoint("llama", path, seed=1, num_layers=NUM_LAYERS, max_positions=2048)
    loaded = load_model(str(path))
    config = KVStoreConfig(
        model_fingerprint=loaded.fingerprint, memory_budget_bytes=1 << 28, stage_kv=True
    )
    with KVStore(config) as store:
        engine = Engine(loaded, store, max_num_seqs=2)
        yield engine
        engine.close()


def _layout(engine: Engine, make_chunks, num_chunks: int) -> PromptLayout:
    chunks = make_chunks(num_chunks, words=24, seed=num_chunks)
    engine.precompute(chunks)
    return engine.layout(GenerateRequest(question="which vo is zuka?", chunks=chunks))


def _direct(engine: Engine, layout: PromptLayout, mode: Mode, ratio: float | None) -> OpCount:
    run_to_end(
        engine.prefiller.prefill(layout, PrefillAsk(mode, ratio))
    )  # warm: the prefix cache, the rope tables
    with counting() as count:
        run_to_end(engine.prefiller.prefill(layout, PrefillAsk(mode, ratio)))
    return count


def _served(engine: Engine, layout: PromptLayout, mode: Mode, ratio: float | None) -> OpCount:
    """One token served; the worker thread's steps counted while it is produced."""
    request = GenerateRequest(question="?", mode=mode, recompute_ratio=ratio, max_tokens=1)
    engine.generate(request, layout)  # warm
    total, done, step = OpCount(), threading.Event(), engine.worker._step

    def counted_step() -> None:
        with counting() as count:
            step()
        nonlocal total
        total += count
        done.set()

    engine.worker._step = counted_step
    try:
        engine.generate(request, layout)
        done.wait(timeout=30)  # the step that emitted the token ends after it
    finally:
        engine.worker._step = step
    return total


@pytest.mark.parametrize("path", [_direct, _served], ids=["direct", "served"])
def test_operations_per_layer_do_not_grow_with_the_chunks(staged_engine, make_chunks, path):
    engine = staged_engine
    counts = {
        (num_chunks, mode): path(engine, _layout(engine, make_chunks, num_chunks), mode, ratio)
        for num_chunks in (4, 16)
        for mode, ratio in CASES
    }
    checks = 2
    for num_chunks in (4, 16):
        full = counts[num_chunks, Mode.FULL_PREFILL].kernels
        for mode in (Mode.FULL_REUSE, Mode.CACHEBLEND):
            assert counts[num_chunks, mode].kernels <= 1.5 * full, (num_chunks, mode, counts)
    for mode, _ in CASES:
        assert counts[16, mode].kernels <= 1.1 * counts[4, mode].kernels, (mode, counts)
    first_token = 1 if path is _served else 0  # the sampled token is read back
    for num_chunks in (4, 16):
        assert counts[num_chunks, Mode.FULL_REUSE].read_backs == first_token
        assert counts[num_chunks, Mode.CACHEBLEND].read_backs == checks + first_token
