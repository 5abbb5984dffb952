"""The held-out questions in collections: no name is shared by two questions' passages within a
collection (so every fact there has one value), and a collection too large for the name pool
is refused."""

from __future__ import annotations

import re

import pytest

from demo.corpus import KINDS, NAMES, TEST_SEED, held_out_collections

POOL = set(NAMES)


def names_in(passages: tuple[str, ...]) -> set[str]:
    return {word for p in passages for word in re.findall(r"\w+", p) if word in POOL}


def test_questions_of_a_collection_share_no_name_and_collections_do():
    collections = held_out_collections(60, TEST_SEED, 20)
    assert [len(c) for c in collections] == [20, 20, 20]
    assert [e.kind for c in collections for e in c] == [KINDS[i % 3] for i in range(60)]
    for collection in collections:
        seen: set[str] = set()
        for example in collection:
            names = names_in(example.passages)
            assert not names & seen, f"{sorted(names & seen)} appear in two questions"
            seen |= names
    first, second = (set().union(*(names_in(e.passages) for e in c)) for c in collections[:2])
    assert first & second  # only within a collection are names unique


def test_a_collection_too_large_for_the_name_pool_or_empty_is_refused():
    with pytest.raises(ValueError, match="names are used"):
        held_out_collections(60, TEST_SEED, 60)
    with pytest.raises(ValueError, match="at least one question"):
        held_out_collections(60, TEST_SEED, 0)
