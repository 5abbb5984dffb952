"""The engine service's gauges of the KV pool, read from a real engine: blocks only idle shared
prompt prefixes hold count as free in the usage ratio (admission gives them back on demand), and
the shared-prefix gauge tells them from those running sequences share."""

from __future__ import annotations

import time

from demo.tiny import random_words
from engine.api.metrics import EngineMetrics
from engine.engine import Engine
from engine.types import GenerateRequest

SYSTEM = " ".join(random_words(60, 4343))  # a prefix of several 16-token blocks
USAGE = "ragblend_engine_kv_pool_usage_ratio"
PREFIX_BLOCKS = "ragblend_engine_kv_shared_prefix_blocks"


def request(chunks, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(
        question="which tas does kalo hold?",
        chunks=chunks,
        system=SYSTEM,
        max_tokens=max_tokens,
        ignore_eos=True,
    )


def gauges(metrics: EngineMetrics) -> tuple[float, float, float]:
    """The pool's usage ratio and its shared prefixes' blocks, shared and idle, in one scrape."""
    values = {
        (s.name, s.labels.get("state")): s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name in (USAGE, PREFIX_BLOCKS)
    }
    return values[USAGE, None], values[PREFIX_BLOCKS, "shared"], values[PREFIX_BLOCKS, "idle"]


def settled(engine: Engine) -> None:
    """Wait until the worker freed the finished sequences (after handing out their results)."""
    deadline = time.monotonic() + 10
    while engine.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.num_running


def test_idle_shared_prefix_blocks_are_not_counted_in_the_pool_usage_ratio(
    checkpoint_dir, make_chunks
):
    engine = Engine.from_pretrained(checkpoint_dir("llama"), check_layers=(1,))
    metrics = EngineMetrics(engine)
    during: list[tuple[float, float, float, int]] = []  # the gauges and the running blocks

    def scrape(_) -> None:
        held = {b for s in engine.scheduler.running for b in s.block_table}
        during.append((*gauges(metrics), len(held)))

    chunks = make_chunks(3, seed=53)
    try:
        engine.precompute(chunks)
        engine.generate(request(chunks[:2], max_tokens=4))
        settled(engine)
        after_first = gauges(metrics)
        engine.add_step_listener(scrape)
        engine.generate(request(chunks[1:], max_tokens=4))
        settled(engine)
        after_second = gauges(metrics)
    finally:
        engine.close()
    num_blocks = engine.scheduler.blocks.num_blocks
    prefix = len(engine.layout(request(chunks, 1)).prefix) // engine.runner.block_size
    assert prefix > 0
    assert after_first == after_second == (0.0, 0.0, prefix)
    # While the second runs it shares the prefix: its blocks are in use, counted once.
    running = [d for d in during if d[3]]
    assert running and all(d[1:3] == (prefix, 0.0) for d in running)
    assert all(d[0] == d[3] / num_blocks for d in running)
