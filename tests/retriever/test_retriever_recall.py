"""Retrieval quality with the real embedding model: on a generated corpus of 200 short
documents with known facts, recall@5 of the chunk holding the answer is at least 0.9."""

from __future__ import annotations

import random

import httpx

NUM_DOCS_PER_KIND = 50
NUM_QUESTIONS = 50
MIN_RECALL_AT_5 = 0.9

SYLLABLES = [
    "bra",
    "dol",
    "fen",
    "gar",
    "hul",
    "kor",
    "lim",
    "mas",
    "nor",
    "pel",
    "quin",
    "ros",
    "sav",
    "tor",
    "ulm",
    "vek",
    "wen",
    "yar",
    "zol",
    "cas",
    "dre",
    "mir",
]
PEOPLE = [
    "Ada Lindqvist",
    "Bruno Castell",
    "Clara Oyelaran",
    "Dmitri Varga",
    "Elena Ruiz",
    "Farid Haddad",
    "Greta Nakamura",
    "Hugo Mbeki",
    "Ines Kowalski",
    "Jonas Achterberg",
]
PRODUCTS = [
    "copper kettles",
    "wool blankets",
    "glass lenses",
    "rope ladders",
    "clay tiles",
    "silk scarves",
    "brass bells",
    "oak barrels",
    "paper lanterns",
    "iron anchors",
]
PLACES = [
    "the Saltmarsh Reef",
    "Cape Norrow",
    "the Bellan Strait",
    "Grey Island",
    "the Ostmark Shoals",
    "Port Elvin",
    "the Amber Banks",
    "Haldor Point",
]
COMPOUNDS = [
    "a blue phosphor",
    "a heat-stable enzyme",
    "a new alloy of tin",
    "a soluble silicate",
    "a bright red dye",
    "a slow-burning fuel",
]

# (document template, question template, kind); {n} is a unique invented name.
KINDS = [
    (
        "{n} is a town on the river {r}. It was founded in {y} by {p}, and its market is "
        "known for {prod}.",
        "Who founded the town of {n}?",
    ),
    (
        "{n} Industries is a company that makes {prod}. Its headquarters are in the city of {c}, "
        "and its chief executive is {p}.",
        "Who is the chief executive of {n} Industries?",
    ),
    (
        "The {n} was a cargo ship launched in {y}. Her captain was {p}, and she sank near {pl} "
        "during a winter storm.",
        "Where did the cargo ship {n} sink?",
    ),
    (
        "Dr. {n} is a chemist who discovered {comp} in {y} while working in a laboratory in {c}.",
        "What did the chemist Dr. {n} discover?",
    ),
]


def _corpus(rng: random.Random) -> tuple[list[str], list[tuple[str, int]]]:
    names: set[str] = set()
    while len(names) < NUM_DOCS_PER_KIND * len(KINDS):
        names.add("".join(rng.sample(SYLLABLES, 3)).capitalize())
    ordered = sorted(names)
    rng.shuffle(ordered)
    docs, questions = [], []
    for i, name in enumerate(ordered):
        template, question = KINDS[i % len(KINDS)]
        fields = {
            "n": name,
            "y": rng.randint(1600, 1990),
            "p": rng.choice(PEOPLE),
            "prod": rng.choice(PRODUCTS),
            "pl": rng.choice(PLACES),
            "comp": rng.choice(COMPOUNDS),
            "r": "".join(rng.sample(SYLLABLES, 2)).capitalize(),
            "c": "".join(rng.sample(SYLLABLES, 2)).capitalize(),
        }
        docs.append(template.format(**fields))
        questions.append((question.format(**fields), i))
    return docs, rng.sample(questions, NUM_QUESTIONS)


def test_recall_at_5_of_the_answer_chunk_is_at_least_0_9(client: httpx.Client):
    docs, questions = _corpus(random.Random(20240529))
    answer_chunk_ids = []
    for text in docs:
        response = client.post("/v1/documents", json={"text": text, "metadata": {"set": "recall"}})
        assert response.status_code == 200, response.text
        chunk_ids = response.json()["chunk_ids"]
        assert len(chunk_ids) == 1  # short documents: the answer chunk is the document
        answer_chunk_ids.append(chunk_ids[0])
    hits, misses = 0, []
    for question, doc_index in questions:
        results = client.post("/v1/search", json={"query": question, "top_k": 5}).json()["results"]
        if answer_chunk_ids[doc_index] in [r["chunk_id"] for r in results]:
            hits += 1
        else:
            misses.append(question)
    recall = hits / len(questions)
    assert recall >= MIN_RECALL_AT_5, f"recall@5 = {recall:.2f}; missed: {misses}"
