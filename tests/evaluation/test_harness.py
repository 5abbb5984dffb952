"""evaluate() in process: retrieval brings each question the documents that match it, and a
missing matplotlib stops the run before any work, naming the package and the way out."""

from __future__ import annotations

import sys

import pytest

from evaluation import evaluate
from evaluation.dataset import Record
from evaluation.plot import MissingDependencyError
from evaluation.retrieval import corpus_of, retrieve


def test_retrieval_gives_each_question_its_top_k_matching_documents():
    documents = [
        "Paris is the capital of France.",
        "Bananas are a yellow fruit rich in potassium.",
        "The Rhine flows from the Alps to the North Sea.",
    ]
    records = [
        Record(question="What is the capital of France?", answers=["Paris"]),
        Record(question="Which river flows to the North Sea?", answers=["the Rhine"]),
    ]
    contexts = retrieve(records, documents, top_k=2, progress=False)
    assert [len(c) for c in contexts] == [2, 2]
    assert contexts[0][0] == documents[0]
    assert contexts[1][0] == documents[2]


def test_the_corpus_of_a_dataset_is_its_passages_each_once():
    records = [
        Record(question="Q?", passages=["a", "b"], answers=["x"]),
        Record(question="Q?", passages=["b", "c"], answers=["x"]),
    ]
    assert corpus_of(records) == ["a", "b", "c"]


def test_a_plot_without_matplotlib_fails_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import` sees when it is absent
    with pytest.raises(MissingDependencyError, match=r"matplotlib.*ragblend\[eval\].*--no-plot"):
        evaluate(tmp_path / "never-read.jsonl", tmp_path, model="never-loaded")
