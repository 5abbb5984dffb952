"""The shipped demo model answers held-out questions, blending at r = 0.15 keeps its quality, and
the corpus generator is seeded. The full sweep is research/quality.py."""

from __future__ import annotations

import statistics

import pytest

from demo import DOCUMENTS_DIR, MODEL_DIR
from demo.corpus import (
    KINDS,
    CorpusGenerator,
    Example,
    held_out,
    is_pronoun_passage,
    named_rivals,
)
from demo.documents import build
from demo.evaluate import Config, answer, exact_match, f1_score
from engine.types import Mode

NUM_QUESTIONS = 30
# The shipped model reaches 0.95 exact match with full prefill on the 300-question held-out set
# (the target: 0.9) and 0.97 on these 30, cacheblend@0.15 the same, full reuse 0.77
# (demo/README.md). A model that does not read its prompt (random init, a broken layout)
# scores ~0.02 by guessing the answer's type; earlier checkpoints 0.60 and 0.77.
FULL_PREFILL_FLOOR = 0.9
DOCUMENTS_FLOOR = 0.9  # 44 of 44 measured on questions.md
CACHEBLEND_MARGIN = 1.5 / NUM_QUESTIONS  # cacheblend@0.15 may miss one question more
# Full reuse drops the cross-chunk attention that context questions need (the paper's finding).
FULL_REUSE_LOSS = 0.15

FULL = Config(Mode.FULL_PREFILL)
BLEND = Config(Mode.CACHEBLEND, 0.15)
REUSE = Config(Mode.FULL_REUSE)


@pytest.fixture(scope="module")
def engine():
    if not (MODEL_DIR / "model.safetensors").exists():
        pytest.fail(f"the demo model is missing from {MODEL_DIR}")
    from engine.engine import Engine

    return Engine.from_pretrained(str(MODEL_DIR), device="cpu", dtype="float32")


def test_full_prefill_answers_cacheblend_keeps_quality_and_full_reuse_loses_it(engine):
    full, blend, reuse = [], [], []
    for example in held_out(NUM_QUESTIONS):
        outcomes = answer(
            engine,
            example.question,
            example.answer,
            example.passages,
            [FULL, BLEND, REUSE],
            measure_deviation=False,
        )
        for scores, outcome in zip((full, blend, reuse), outcomes, strict=True):
            scores.append(outcome.exact_match)
    full_em, blend_em, reuse_em = map(statistics.fmean, (full, blend, reuse))
    assert full_em >= FULL_PREFILL_FLOOR, f"full_prefill exact match {full_em:.3f}"
    assert blend_em >= full_em - CACHEBLEND_MARGIN, (
        f"cacheblend@0.15 exact match {blend_em:.3f} vs full_prefill {full_em:.3f}"
    )
    assert reuse_em <= full_em - FULL_REUSE_LOSS, (
        f"full_reuse exact match {reuse_em:.3f} vs full_prefill {full_em:.3f}"
    )


def test_answers_questions_about_the_bundled_documents(engine):
    files, questions = build()
    assert sorted(p.name for p in DOCUMENTS_DIR.glob("*.md")) == sorted(files)
    for name, text in files.items():
        assert (DOCUMENTS_DIR / name).read_text() == text
    scores = []
    for q in questions:
        passages = [p for f in q.files for p in files[f].strip().split("\n\n")]
        outcome = answer(engine, q.question, q.answer, passages, [FULL], measure_deviation=False)[0]
        scores.append(outcome.exact_match)
    assert statistics.fmean(scores) >= DOCUMENTS_FLOOR


def test_corpus_is_seeded_and_context_passages_follow_their_referent():
    first = list(CorpusGenerator(5).examples(50))
    assert first == list(CorpusGenerator(5).examples(50))
    assert first != list(CorpusGenerator(6).examples(50))
    held = held_out(30)
    assert [e.kind for e in held[:3]] == list(KINDS)
    for example in held:
        assert 3 <= len(example.passages) <= 6
        if example.kind == "context":
            named, pronoun = example.gold
            assert pronoun == named + 1
            assert is_pronoun_passage(example.passages[pronoun])
            assert example.answer in example.passages[pronoun]
        if example.kind == "multi":
            assert len(example.gold) == 2


def test_named_rivals_counts_passages_stating_the_asked_relation_by_name():
    passages = (
        "The city of Braigi? It is Houstom. The job of Braigi? It is baker.",
        "The city of Loumei? It is Rurkra.",
        "Their city? It is Gassair.",  # by pronoun: not a named rival
        "The horse of Zanos? It is Veltor.",
    )
    example = Example("What is the city of Braigi?", "Houstom", "single", passages, (0,))
    assert named_rivals(example) == 2
    horse = Example("What is the horse of Zanos?", "Veltor", "single", passages, (3,))
    assert named_rivals(horse) == 1
    with pytest.raises(ValueError, match="not a corpus question"):
        named_rivals(Example("Who is Zanos?", "a person", "single", passages, ()))


def test_scores():
    assert exact_match(" The Kelmora.", "kelmora") == 1.0
    assert exact_match("Kelmora river", "Kelmora") == 0.0
    assert f1_score("Kelmora river", "Kelmora") == pytest.approx(2 / 3)
    assert f1_score("", "Kelmora") == 0.0
