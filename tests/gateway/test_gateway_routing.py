"""Rendezvous hashing of chunk sets onto engines (pure functions, no processes)."""

from __future__ import annotations

from gateway.routing import rank_engines

ENGINES = [f"http://10.0.0.{i}:8002" for i in range(1, 5)]


def test_ranking_ignores_the_order_and_repetition_of_chunk_ids():
    assert rank_engines(ENGINES, ["a", "b", "c"]) == rank_engines(ENGINES, ["c", "a", "b", "a"])


def test_removing_an_engine_moves_only_the_chunk_sets_it_was_serving():
    sets = [[f"chunk-{i}", f"chunk-{i + 1}"] for i in range(200)]
    before = {tuple(s): rank_engines(ENGINES, s)[0] for s in sets}
    survivors = ENGINES[1:]
    for chunk_set, chosen in before.items():
        after = rank_engines(survivors, chunk_set)[0]
        if chosen != ENGINES[0]:
            assert after == chosen
        else:
            # Failover goes to the next engine of the original ranking.
            assert after == rank_engines(ENGINES, chunk_set)[1]


def test_chunk_sets_spread_over_all_engines():
    chosen = [rank_engines(ENGINES, [f"c{i}"])[0] for i in range(400)]
    assert all(60 < chosen.count(url) < 140 for url in ENGINES)
