"""Prompt prefixes shared in the engine's KV pool: requests with one system prompt decode from the
same first blocks and get the tokens they get without sharing; full prefills never share."""

from __future__ import annotations

import pytest

from demo.tiny import FAMILIES, random_words
from engine.engine import Engine
from engine.sched.job import Job
from engine.types import GenerateRequest, Mode, StepRecord
from tests.engine.serving import while_first_decodes

SYSTEM = " ".join(random_words(60, 4242))  # a prefix of several 16-token blocks


def request(chunks, **overrides) -> GenerateRequest:
    """Blends recompute every token: below ratio 1 a selection by deviation can flip a
    borderline token on a last-bit difference between two equal prefixes' KV (computed in
    forwards of other shapes), and a random-init model's tokens then part ways."""
    values = {
        "recompute_ratio": 1.0,
        "question": "which tas does kalo hold?",
        "chunks": chunks,
        "system": SYSTEM,
        "max_tokens": 8,
        "ignore_eos": True,
    }
    return GenerateRequest(**{**values, **overrides})


@pytest.mark.parametrize("family", FAMILIES)
def test_requests_with_one_system_prompt_share_its_blocks_and_get_the_same_tokens(
    checkpoint_dir, make_chunks, family
):
    # A step budget that admits the three later requests beside the first's decode (a measured
    # one depends on the machine's speed at start).
    options = {"check_layers": (1,), "max_num_batched_tokens": 4096}
    shared = Engine.from_pretrained(checkpoint_dir(family), **options)
    alone = Engine.from_pretrained(checkpoint_dir(family), **options)
    alone.scheduler.prefixes.capacity = 0  # the same engine without sharing in the pool
    chunks = make_chunks(4, seed=51)
    first = request(chunks[:2], max_tokens=16)
    blended = request(chunks[2:])
    prefix_cached = request(chunks[1:3], mode=Mode.PREFIX_CACHE)
    full = request(chunks[:3], mode=Mode.FULL_PREFILL)
    later = [blended, prefix_cached, full]
    snapshots: list[list[tuple[GenerateRequest, list[int], int, list[int]]]] = []

    def snapshot(_: StepRecord) -> None:
        running: list[Job] = shared.scheduler.running
        blocks = shared.scheduler.blocks
        snapshots.append(
            [
                (
                    s.request,
                    list(s.block_table),
                    s.num_shared_tokens,
                    [blocks.refcount(b) for b in s.block_table],
                )
                for s in running
            ]
        )

    shared.add_step_listener(snapshot)
    try:
        for engine in (shared, alone):
            engine.precompute(chunks)
        got = while_first_decodes(shared, first, later)
        want = while_first_decodes(alone, first, later)
        assert alone.scheduler.prefixes.num_blocks == 0
    finally:
        shared.close()
        alone.close()
    assert got == want

    num_shared = len(shared.layout(first).prefix) // shared.runner.block_size
    assert num_shared >= 3
    all_four = [s for s in snapshots if len(s) == 4]
    assert all_four, "the later requests ran beside the first"
    by_request = {req: (table, n, refs) for req, table, n, refs in all_four[0]}
    head = by_request[first][0][:num_shared]
    for req in (blended, prefix_cached):
        table, n, refs = by_request[req]
        assert table[:num_shared] == head and n == num_shared * shared.runner.block_size
        # The first, the two later ones, and the registry.
        assert refs[:num_shared] == [4] * num_shared and set(refs[num_shared:]) == {1}
    table, n, _ = by_request[full]
    assert n == 0 and not set(table) & set(head)


def test_a_request_that_ends_with_its_prefill_leaves_its_prefix_to_the_next(
    checkpoint_dir, make_chunks
):
    """The first request's only token comes with its prefill: it finishes in that step, and its
    prefix is registered all the same; the next request shares it, with the same tokens."""
    shared = Engine.from_pretrained(checkpoint_dir("llama"), check_layers=(1,))
    alone = Engine.from_pretrained(checkpoint_dir("llama"), check_layers=(1,))
    alone.scheduler.prefixes.capacity = 0
    chunks = make_chunks(3, seed=52)
    first, second = request(chunks[:2], max_tokens=1), request(chunks[1:])
    num_shared: list[int] = []  # each running sequence's shared positions, after every step
    shared.add_step_listener(
        lambda _: num_shared.extend(s.num_shared_tokens for s in shared.scheduler.running)
    )
    try:
        tokens = {}
        for engine in (shared, alone):
            engine.precompute(chunks)
            # The second is queued once the first's result came: admitted in a later step.
            tokens[engine] = [engine.generate(r).token_ids for r in (first, second)]
    finally:
        shared.close()
        alone.close()
    assert tokens[shared] == tokens[alone] and len(tokens[shared][0]) == 1
    block = shared.runner.block_size
    prefix_positions = len(shared.layout(second).prefix) // block * block
    assert prefix_positions > 0
    assert num_shared and set(num_shared) == {prefix_positions}, "the second shared every step"
