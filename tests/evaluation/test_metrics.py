"""The answer scores, checked by hand: exact match, token F1 and ROUGE-L over normalized words,
and the best score over several gold answers."""

from __future__ import annotations

import pytest

from evaluation.metrics import best, exact_match, f1_score, normalize, rouge_l


def test_normalize_drops_case_punctuation_articles_and_extra_spaces():
    assert normalize("  The Kelmora,  RIVER! ") == "kelmora river"
    assert normalize("an apple a day") == "apple day"
    assert normalize("Theatre") == "theatre"  # only whole-word articles go


def test_exact_match_compares_normalized_text():
    assert exact_match(" The Kelmora.", "kelmora") == 1.0
    assert exact_match("Kelmora river", "Kelmora") == 0.0


def test_f1_counts_shared_words_as_multisets():
    assert f1_score("Kelmora river", "Kelmora") == pytest.approx(2 / 3)
    # two shared "y"s: precision 2/3, recall 2/3
    assert f1_score("x y y", "y y z") == pytest.approx(2 / 3)
    assert f1_score("", "Kelmora") == 0.0
    assert f1_score("north", "south") == 0.0


def test_rouge_l_is_the_f_measure_of_the_longest_common_subsequence():
    # LCS "w y z": precision 3/3, recall 3/4 -> 2 * 1 * 0.75 / 1.75
    assert rouge_l("w y z", "w x y z") == pytest.approx(6 / 7)
    # LCS "police gunman" (articles dropped): precision 2/3, recall 2/3
    assert rouge_l("police killed the gunman", "police kill the gunman") == pytest.approx(2 / 3)
    assert rouge_l("Kelmora", "the kelmora.") == 1.0
    assert rouge_l("", "Kelmora") == 0.0


def test_rouge_l_counts_word_order_where_f1_does_not():
    prediction, gold = "gunman kill police", "police kill gunman"
    assert f1_score(prediction, gold) == 1.0
    assert rouge_l(prediction, gold) == pytest.approx(1 / 3)  # LCS of one word


def test_rouge_l_is_symmetric_in_lcs_length():
    a, b = "x y z x y z x", "z z x y q"
    assert rouge_l(a, b) == pytest.approx(rouge_l(b, a))


def test_best_takes_the_closest_gold_answer():
    answers = ["Kelmora", "the Kelmora river"]
    assert best(exact_match, "Kelmora river", answers) == 1.0
    assert best(f1_score, "river", answers) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="no gold answers"):
        best(f1_score, "river", [])
