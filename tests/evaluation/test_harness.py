"""evaluate() in process: retrieval brings each question the documents that match it, a
missing matplotlib stops the run before any work, naming the package and the way out, and
chunk_order best_last lays the passages out reversed."""

from __future__ import annotations

import json
import sys

import pytest

from demo import MODEL_DIR
from demo.corpus import TEST_SEED, held_out
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


def write_dataset(path, examples, reverse: bool) -> None:
    lines = []
    for e in examples:
        passages = list(e.passages[::-1] if reverse else e.passages)
        lines.append(
            json.dumps({"question": e.question, "passages": passages, "answers": [e.answer]})
        )
    path.write_text("\n".join(lines) + "\n")


def test_best_last_evaluates_the_passages_reversed(tmp_path):
    examples = held_out(4, TEST_SEED)
    write_dataset(tmp_path / "as_given.jsonl", examples, reverse=False)
    write_dataset(tmp_path / "reversed.jsonl", examples, reverse=True)
    ask = dict(model=str(MODEL_DIR), modes=["cacheblend"], ratios=[0.15], plot=False)
    ask |= dict(progress=False, max_tokens=4)

    def deviations(name: str, order: str) -> list[float]:
        report = evaluate(tmp_path / name, chunk_order=order, **ask)
        return [o.kv_deviation for o in report.outcomes if o.setting.mode == "cacheblend"]

    best_last = deviations("as_given.jsonl", "best_last")
    assert best_last == pytest.approx(deviations("reversed.jsonl", "best_first"), abs=1e-6)
    as_given = deviations("as_given.jsonl", "best_first")
    assert max(abs(a - b) for a, b in zip(best_last, as_given, strict=True)) > 1e-4
