"""A conversation on the bundled model: the follow-up is answered from the turn before it,
which the prompt carries after the passages (greedy decoding, the serving mode cacheblend)."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.types import Chunk, GenerateRequest, Turn
from tests import real_model

smollm2_dir = real_model.smollm2_dir

PASSAGES = (
    Chunk("alice", "Alice Brown was born in Paris. She works as a pilot."),
    Chunk("tom", "Tom Green was born in Oslo. He works as a baker."),
)
EARLIER = (Turn("user", "Where was Alice Brown born?"), Turn("assistant", "In Paris."))
FOLLOW_UP = "What does she work as?"


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> Engine:
    engine = Engine.from_pretrained(str(smollm2_dir))
    engine.precompute(PASSAGES)
    return engine


@pytest.mark.parametrize("chunks", [PASSAGES, PASSAGES[::-1]], ids=["alice_first", "tom_first"])
def test_a_follow_up_is_answered_from_the_turn_before_it(smollm2, chunks):
    def answer(history: tuple[Turn, ...]) -> str:
        ask = GenerateRequest(
            question=FOLLOW_UP, chunks=chunks, history=history, max_tokens=16, temperature=0.0
        )
        return smollm2.generate(ask).text

    with_turns = answer(EARLIER)
    assert "pilot" in with_turns and "baker" not in with_turns, with_turns
    # Without the earlier turns "she" names no one: the model answers about Tom.
    without = answer(())
    assert "pilot" not in without, without
