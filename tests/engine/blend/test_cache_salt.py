"""Chunks scoped by a cache salt (a tenant's): their KV is stored and found under their salt
only, written back under it, and the prompt prefix cached under the request's; passages sent
again in another order reuse their KV, and at ratio 1 match full prefill."""

from __future__ import annotations

import dataclasses

import torch

from engine.blend.plan import ChunkSource
from engine.types import Chunk, GenerateRequest, Mode

RTOL, ATOL = 1e-4, 1e-5


def request(chunks, **overrides) -> GenerateRequest:
    return GenerateRequest(question="which vo is zuka?", chunks=chunks, **overrides)


def salted(chunks: tuple[Chunk, ...], salt: str) -> tuple[Chunk, ...]:
    return tuple(dataclasses.replace(c, cache_salt=salt) for c in chunks)


def test_a_chunk_stored_under_one_salt_is_found_under_that_salt_only(engine_for, make_chunks):
    engine = engine_for("llama")
    chunks = make_chunks(2, seed=9071)
    engine.precompute(salted(chunks, "tenant-a"))
    compute, blend = (ChunkSource.COMPUTE,) * 2, (ChunkSource.BLEND,) * 2
    assert engine.prefill(request(salted(chunks, "tenant-b"))).plan.chunk_sources == compute
    assert engine.prefill(request(chunks)).plan.chunk_sources == compute
    assert engine.prefill(request(salted(chunks, "tenant-a"))).plan.chunk_sources == blend


def test_a_missing_chunk_is_written_back_under_its_own_salt(engine_for, make_chunks):
    engine = engine_for("llama")
    (chunk,) = salted(make_chunks(1, seed=9073), "tenant-b")
    tokens = engine.prompts.chunk_tokens(chunk.text)
    engine.generate(request((chunk,)))
    engine.drain()
    assert engine.store.lookup([engine.chunk_key(tokens, "tenant-b")])[0] is not None
    assert engine.store.lookup([engine.chunk_key(tokens, "tenant-a")]) == [None]
    assert engine.store.lookup([engine.chunk_key(tokens)]) == [None]


def test_the_prompt_prefix_is_reused_under_the_requests_salt_only(engine_for, make_chunks):
    engine = engine_for("llama")
    chunks = make_chunks(1, seed=9075)
    system = "You answer in one word, tenant a."
    engine.prefill(request(chunks, system=system, cache_salt="tenant-a"))  # fills the cache
    again = engine.prefill(request(chunks, system=system, cache_salt="tenant-a"))
    other = engine.prefill(request(chunks, system=system, cache_salt="tenant-b"))
    assert again.plan.prefix_cached and not other.plan.prefix_cached


def test_passages_in_another_order_reuse_their_kv_and_match_full_prefill_at_ratio_one(
    engine_for, make_chunks
):
    engine = engine_for("llama")
    passages = salted(make_chunks(3, seed=9077), "tenant-a")
    engine.generate(request(passages))  # first sight: computed in full, written back
    engine.drain()
    reordered = (passages[2], passages[0], passages[1])
    blended = engine.prefill(request(reordered, recompute_ratio=0.15))
    assert blended.plan.chunk_sources == (ChunkSource.BLEND,) * 3
    chunk_tokens = sum(length for _, length in blended.layout.chunk_spans)
    prefix = blended.plan.prefix_len if blended.plan.prefix_cached else 0
    usage = blended.usage
    assert 0 < usage.cached_tokens - prefix < chunk_tokens
    assert usage.cached_tokens - prefix == chunk_tokens - blended.output.num_selected

    exact = engine.prefill(request(reordered, recompute_ratio=1.0))
    full = engine.prefill(request(reordered, mode=Mode.FULL_PREFILL))
    assert exact.plan.chunk_sources == (ChunkSource.BLEND,) * 3
    torch.testing.assert_close(exact.output.logits, full.output.logits, rtol=RTOL, atol=ATOL)
    greedy = {"temperature": 0.0, "max_tokens": 8}
    answer = engine.generate(request(reordered, recompute_ratio=1.0, **greedy))
    reference = engine.generate(request(reordered, mode=Mode.FULL_PREFILL, **greedy))
    assert answer.usage.cached_tokens > 0
    assert answer.token_ids == reference.token_ids
