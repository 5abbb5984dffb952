"""Engine fixtures: one Engine per family, with a memory-only KV store."""

from __future__ import annotations

import pytest

from demo.tiny import random_words
from engine.engine import Engine
from engine.types import Chunk


@pytest.fixture(scope="session")
def engine_for(checkpoint_dir):
    engines: dict[tuple[str, tuple[int, ...]], Engine] = {}

    def get(family: str, check_layers: tuple[int, ...] = (1,)) -> Engine:
        key = (family, check_layers)
        if key not in engines:
            engines[key] = Engine.from_pretrained(checkpoint_dir(family), check_layers=check_layers)
        return engines[key]

    yield get
    for engine in engines.values():
        engine.close()


@pytest.fixture
def make_chunks():
    """count chunks of random words; the same seed gives the same texts."""

    def make(count: int, words: int = 24, seed: int = 0) -> tuple[Chunk, ...]:
        return tuple(
            Chunk(f"c{seed}-{i}", " ".join(random_words(words, seed * 1000 + i)))
            for i in range(count)
        )

    return make
