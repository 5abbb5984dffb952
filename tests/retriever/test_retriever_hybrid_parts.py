"""The parts of hybrid retrieval without the service: the FTS5 table of the real SQLite catalog
(kept in step with chunk writes, built for a catalog that predates it), the query escaping, rank
fusion and the second hop's entity extraction."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from retriever.bm25 import MAX_TERMS, match_expression, terms
from retriever.catalog import FTS_TABLE, Catalog, ChunkRecord
from retriever.fusion import reciprocal_rank_fusion
from retriever.hops import entities, second_hop_query

DIM = 4


def _put(catalog: Catalog, doc_id: str, *texts: str, collection: str = "default") -> None:
    chunks = [ChunkRecord(f"{doc_id}-{i}", i, t, 5, 0, len(t)) for i, t in enumerate(texts)]
    vectors = np.ones((len(texts), DIM), dtype=np.float32)
    catalog.put_document(collection, doc_id, doc_id, {}, 10, chunks, vectors)


def _found(catalog: Catalog, query: str, **filters) -> list[str]:
    """The texts BM25 ranks for `query`, best first."""
    match = match_expression(query)
    assert match is not None
    hits = catalog.bm25(match, 10, **filters)
    texts = catalog.chunks_by_rowid([rowid for rowid, _ in hits])
    return [texts[rowid].text for rowid, _ in hits]


def _integrity_ok(path: Path) -> None:
    """FTS5's own check that the index matches the chunks table (raises when it does not)."""
    with sqlite3.connect(path) as conn:
        conn.execute(f"INSERT INTO {FTS_TABLE} ({FTS_TABLE}, rank) VALUES ('integrity-check', 1)")


def test_bm25_follows_inserts_replacements_and_deletes_in_the_same_transactions(tmp_path):
    catalog = Catalog(tmp_path / "catalog.sqlite3")
    _put(catalog, "mill", "The Wexaldor mill grinds rye.", "Its sails are red.")
    _put(catalog, "other", "A bakery sells rye bread.")
    assert _found(catalog, "wexaldor") == ["The Wexaldor mill grinds rye."]
    assert _found(catalog, "sails") == ["Its sails are red."]

    _put(catalog, "mill", "The Brimvolk mill grinds oats.")  # same id, new text: replaced
    assert _found(catalog, "wexaldor") == [] and _found(catalog, "sails") == []
    assert _found(catalog, "Brimvolk") == ["The Brimvolk mill grinds oats."]

    assert catalog.delete_document("default", "mill") is not None
    assert _found(catalog, "brimvolk") == []
    assert _found(catalog, "rye") == ["A bakery sells rye bread."]
    _integrity_ok(catalog.path)


def test_a_failed_write_leaves_the_full_text_index_unchanged(tmp_path):
    catalog = Catalog(tmp_path / "catalog.sqlite3")
    _put(catalog, "mill", "The Wexaldor mill grinds rye.")
    chunks = [ChunkRecord("a", 0, "Quorvent tower", 2, 0, 14)] * 2  # same position twice
    with pytest.raises(sqlite3.IntegrityError):
        catalog.put_document("default", "mill", "x", {}, 10, chunks, np.ones((2, DIM)))
    assert _found(catalog, "quorvent") == []
    assert _found(catalog, "wexaldor") == ["The Wexaldor mill grinds rye."]
    _integrity_ok(catalog.path)


def test_bm25_searches_only_the_given_collections_and_doc_ids(tmp_path):
    catalog = Catalog(tmp_path / "catalog.sqlite3")
    _put(catalog, "a", "Selvik harbour, pier one.", collection="north")
    _put(catalog, "b", "Selvik harbour, pier two.", collection="south")
    _put(catalog, "c", "Selvik harbour, pier three.", collection="south")
    assert _found(catalog, "selvik", collections=["north"]) == ["Selvik harbour, pier one."]
    assert _found(catalog, "selvik", collections=["south"], doc_ids=["c"]) == [
        "Selvik harbour, pier three."
    ]
    assert len(_found(catalog, "selvik")) == 3


def test_a_catalog_without_the_full_text_table_gets_it_backfilled_on_open(tmp_path):
    path = tmp_path / "catalog.sqlite3"
    _put(Catalog(path), "mill", "The Wexaldor mill grinds rye.")
    with sqlite3.connect(path) as conn:  # as written before the table existed
        for trigger in ("chunks_fts_insert", "chunks_fts_delete", "chunks_fts_update"):
            conn.execute(f"DROP TRIGGER {trigger}")
        conn.execute(f"DROP TABLE {FTS_TABLE}")
    reopened = Catalog(path)
    assert _found(reopened, "wexaldor") == ["The Wexaldor mill grinds rye."]
    _put(reopened, "tower", "The Quorvent tower is tall.")
    assert _found(reopened, "quorvent") == ["The Quorvent tower is tall."]
    _integrity_ok(path)


def test_bm25_scores_are_negated_bm25_best_first(tmp_path):
    catalog = Catalog(tmp_path / "catalog.sqlite3")
    _put(catalog, "a", "Selvik Selvik Selvik harbour.")
    _put(catalog, "b", "Selvik harbour and many other words about boats and nets.")
    _put(catalog, "c", "Nothing here.")
    match = match_expression("Selvik")
    assert match is not None
    scores = [score for _, score in catalog.bm25(match, 10)]
    assert len(scores) == 2 and scores[0] > scores[1] > 0


PLAIN_WORDS = (
    "x marks",
    "y axis",
    "and then",
    "not now",
    "near miss",
    "title page",
    "start up",
    "b side",
)


@pytest.mark.parametrize(
    ("query", "found"),
    [
        ('"', set()),  # punctuation only: no words, nothing to match
        ("*", set()),
        ("AND", {"and then"}),
        ("NEAR(", {"near miss"}),
        ('a "b', {"b side"}),  # "a" is a stopword
        ("title:x", {"title page", "x marks"}),
        ("-x", {"x marks"}),
        ("^start", {"start up"}),
        ("(x OR", {"x marks"}),
        ("x NOT y", {"x marks", "not now", "y axis"}),
    ],
)
def test_fts5_syntax_in_a_query_is_matched_as_plain_words(tmp_path, query, found):
    catalog = Catalog(tmp_path / "catalog.sqlite3")
    _put(catalog, "a", *PLAIN_WORDS)
    match = match_expression(query)
    # An operator or column filter that reached FTS5 would raise or change the chunks found.
    assert set(_found(catalog, query) if match is not None else []) == found


def test_query_terms_drop_stopwords_unless_nothing_else_is_left_and_are_bounded():
    assert terms("What is the river of the city of Braigi?") == ["river", "city", "braigi"]
    assert terms("What is it?") == ["what", "is", "it"]
    assert terms("?!") == [] and match_expression("?!") is None
    assert len(terms(" ".join(f"w{i}" for i in range(1000)))) == MAX_TERMS
    assert match_expression('say "NEAR(x)"') == '"say" OR "near" OR "x"'


def test_rank_fusion_adds_reciprocal_ranks_and_breaks_ties_by_the_first_list():
    fused = reciprocal_rank_fusion([[1, 2, 3], [3, 4]], k=60)
    assert [i for i, _ in fused] == [3, 1, 2, 4]
    assert dict(fused)[3] == pytest.approx(1 / 63 + 1 / 61)
    assert [i for i, _ in reciprocal_rank_fusion([[5], [6]], k=60)] == [5, 6]


def test_entities_are_capitalised_names_not_starting_a_sentence_nor_in_the_question():
    question = "What is the river of the city of Braigi?"
    chunks = [
        "The city of Braigi? It is Houstom. The horse of Braigi? It is Velk.",
        "Ada Lindqvist met Bruno Castell in Paris.\nI said: Hello there.",
    ]
    assert entities(question, chunks) == ["Houstom", "Velk", "Lindqvist", "Bruno Castell", "Paris"]
    assert entities(question, chunks, limit=2) == ["Houstom", "Velk"]
    assert entities(question, ["no names here. None."]) == []


def test_the_second_hop_query_asks_the_question_about_the_entity():
    question = "What is the river of the city of Braigi?"
    assert second_hop_query(question, "Houstom") == "What is the river of the city of Houstom?"
    assert second_hop_query("which river is it?", "Houstom") == "which river is it? Houstom"
