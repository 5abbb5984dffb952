"""Bad input to the engine is a clear error naming the problem."""

from __future__ import annotations

from dataclasses import replace

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from demo.tiny import build_tokenizer, random_words
from engine.engine import Engine
from engine.errors import (
    ChunkTooLongError,
    InvalidRequestError,
    ModelNotFoundError,
    ModelNotSupportedError,
    PromptTooLongError,
)
from engine.model.load import load_model
from engine.types import Chunk, GenerateRequest, Turn
from kvstore import tiers


def test_empty_question_is_rejected():
    with pytest.raises(ValueError, match="question must not be empty"):
        GenerateRequest(question="   ")


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_recompute_ratio_outside_unit_interval_is_rejected(ratio):
    with pytest.raises(ValueError, match="recompute_ratio must be in"):
        GenerateRequest(question="q", recompute_ratio=ratio)


def test_unknown_mode_is_rejected_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown mode 'turbo'.*cacheblend.*full_prefill"):
        GenerateRequest(question="q", mode="turbo")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, "max_tokens"),
        ("temperature", -1.0, "temperature"),
        ("top_p", 0.0, "top_p"),
    ],
)
def test_bad_sampling_parameters_are_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        GenerateRequest(question="q", **{field: value})


@pytest.mark.parametrize(
    ("history", "message"),
    [
        ((Turn("assistant", "hi"), Turn("user", "q")), "history.0.role is 'assistant'"),
        ((Turn("user", "a"), Turn("user", "b")), "history.1.role is 'user'"),
        ((Turn("user", "a"),), "ends with a user turn"),
        ((Turn("user", "a"), Turn("assistant", " ")), "history.1.text must not be empty"),
        ((Turn("user", "a"), Turn("assistant", "b")) * 129, "has 258 turns: more than the limit"),
    ],
)
def test_a_history_that_is_not_user_and_assistant_alternating_is_rejected(history, message):
    with pytest.raises(InvalidRequestError, match=message):
        GenerateRequest(question="q", history=history)


def _turns(exchanges: int) -> tuple[Turn, ...]:
    return tuple(
        Turn(role, " ".join(random_words(20, 200 + 2 * i + (role == "user"))))
        for i in range(exchanges)
        for role in ("user", "assistant")
    )


def test_fit_context_drops_the_oldest_turns_then_chunks_then_the_last_exchange(engine_for):
    engine = engine_for("qwen2")  # a chat template
    limit = engine.max_model_len
    history = _turns(4)
    chunks = tuple(Chunk(f"c{i}", " ".join(random_words(30, 90 + i))) for i in range(2))

    def tokens(kept_turns: tuple[Turn, ...], kept_chunks: tuple[Chunk, ...]) -> int:
        asked = GenerateRequest(question="q", chunks=kept_chunks, history=kept_turns)
        return engine.layout(asked).num_tokens

    def fitted(budget: int) -> GenerateRequest:
        return GenerateRequest(
            question="q",
            chunks=chunks,
            history=history,
            max_tokens=limit - budget,
            fit_context=True,
        )

    assert tokens(history, chunks) < limit
    # Room for all but the oldest exchange: it goes, and nothing else.
    layout = engine.layout(fitted(tokens(history[2:], chunks)))
    assert (layout.dropped_turns, layout.dropped_chunks) == (2, 0)
    assert (
        layout.token_ids
        == engine.layout(
            GenerateRequest(question="q", chunks=chunks, history=history[2:])
        ).token_ids
    )
    assert engine.generate(fitted(tokens(history[2:], chunks))).dropped_turns == 2
    # Not even the last exchange with every chunk: the worst chunk goes before that exchange.
    layout = engine.layout(fitted(tokens(history[6:], chunks) - 1))
    assert (layout.dropped_turns, layout.dropped_chunks) == (6, 1)
    assert layout.num_tokens == tokens(history[6:], chunks[:1])
    # Not the last exchange alone: it goes too, and the chunks that then fit come back.
    layout = engine.layout(fitted(tokens(history[6:], ()) - 1))
    assert layout.dropped_turns == 8 and layout.dropped_chunks < 2
    kept = chunks[: 2 - layout.dropped_chunks]
    assert layout.num_tokens == tokens((), kept)


def test_prompt_longer_than_the_models_positions_is_rejected(engine_for):
    engine = engine_for("llama")
    huge = Chunk("big", " ".join(random_words(1500, 99)))
    with pytest.raises(PromptTooLongError, match="maximum of 1024 positions"):
        engine.generate(GenerateRequest(question="q", chunks=(huge,)))


def test_a_chunk_longer_than_a_prompt_can_hold_is_refused_before_any_compute(engine_for):
    engine = engine_for("llama")
    fine = Chunk("fine", "kalo zu ka.")
    huge = Chunk("huge", " ".join(random_words(1500, 98)))
    before = engine.store.stats().tiers[tiers.MEMORY].entries
    with pytest.raises(ChunkTooLongError, match=r"chunk 'huge' has \d+ tokens"):
        engine.precompute([fine, huge])
    assert engine.store.stats().tiers[tiers.MEMORY].entries == before  # not even the fine one


def test_fit_context_drops_chunks_from_the_end_and_says_how_many(engine_for):
    engine = engine_for("llama")
    chunks = tuple(Chunk(f"c{i}", " ".join(random_words(300, 70 + i))) for i in range(5))
    fitted = GenerateRequest(question="q", chunks=chunks, max_tokens=8, fit_context=True)
    layout = engine.layout(fitted)
    assert 0 < layout.dropped_chunks < 5
    assert layout.num_tokens + 8 <= engine.max_model_len
    kept = chunks[: 5 - layout.dropped_chunks]
    plain = engine.layout(GenerateRequest(question="q", chunks=kept, max_tokens=8))
    assert plain.token_ids == layout.token_ids
    result = engine.generate(fitted)
    assert result.dropped_chunks == layout.dropped_chunks


def test_best_last_drops_the_worst_chunks_then_puts_the_best_next_to_the_question(engine_for):
    engine = engine_for("llama")
    chunks = tuple(Chunk(f"c{i}", " ".join(random_words(120, 80 + i))) for i in range(5))
    ask = {"question": "q", "max_tokens": 8, "fit_context": True}
    best_last = GenerateRequest(chunks=chunks, chunk_order="best_last", **ask)
    layout = engine.layout(best_last)
    kept = chunks[: 5 - layout.dropped_chunks]
    assert 0 < layout.dropped_chunks < 4  # at least two kept, so their order matters
    reversed_by_hand = GenerateRequest(chunks=kept[::-1], **ask)
    assert layout.token_ids == engine.layout(reversed_by_hand).token_ids
    assert layout.token_ids != engine.layout(GenerateRequest(chunks=chunks, **ask)).token_ids
    engine.precompute(chunks[:1])  # only the best chunk is stored: the others are misses
    result = engine.generate(best_last)
    assert result.chunk_tiers[0] is not None  # reported in the request's order
    assert result.chunk_tiers[1:] == [None] * (len(kept) - 1)
    # Full prefill: the same prompt gives the same text (a blend's KV depends on the tiers).
    exact = {"mode": "full_prefill"}
    by_order = replace(best_last, **exact)
    assert (
        engine.generate(by_order).text == engine.generate(replace(reversed_by_hand, **exact)).text
    )


def test_an_unknown_chunk_order_is_an_invalid_request():
    with pytest.raises(InvalidRequestError, match="chunk_order 'worst_first'"):
        GenerateRequest(question="q", chunk_order="worst_first")


def test_fit_context_cannot_fit_a_question_longer_than_the_positions(engine_for):
    engine = engine_for("llama")
    question = " ".join(random_words(1500, 97))
    with pytest.raises(PromptTooLongError):
        engine.layout(GenerateRequest(question=question, fit_context=True))


def test_unknown_model_path_is_rejected(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_model(str(tmp_path / "nowhere"))


def test_unsupported_architecture_fails_at_load_listing_the_supported(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path
    )
    build_tokenizer(64).save_pretrained(tmp_path)
    with pytest.raises(ModelNotSupportedError, match="'gpt2'.*llama, mistral, qwen2, qwen3"):
        Engine.from_pretrained(str(tmp_path))


def test_unknown_dtype_is_rejected(checkpoint_dir):
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_model(checkpoint_dir("llama"), dtype="float8")


def test_check_layer_beyond_the_model_is_rejected(checkpoint_dir):
    with pytest.raises(ValueError, match="check layers"):
        Engine.from_pretrained(checkpoint_dir("llama"), check_layers=(9,))
