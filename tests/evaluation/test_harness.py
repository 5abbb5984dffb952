"""evaluate() in process: retrieval brings each question the documents that match it, a
missing matplotlib stops the run before any work, naming the package and the way out,
chunk_order best_last lays the passages out reversed, and each token selection asked for is its
own setting, passed to the engine and named in the outputs."""

from __future__ import annotations

import csv
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


def test_each_selection_is_run_and_reported_as_its_own_setting(tmp_path, monkeypatch):
    from engine.engine import Engine

    asked: list[tuple[object, object]] = []  # (ratio, selection) of each cacheblend prefill
    prefill = Engine.prefill

    def spy(self, request, *args, **kwargs):
        if request.mode == "cacheblend":
            asked.append((request.recompute_ratio, request.selection))
        return prefill(self, request, *args, **kwargs)

    monkeypatch.setattr(Engine, "prefill", spy)
    write_dataset(tmp_path / "data.jsonl", held_out(3, TEST_SEED), reverse=False)
    report = evaluate(
        tmp_path / "data.jsonl",
        tmp_path / "out",
        model=str(MODEL_DIR),
        modes=["full_reuse", "cacheblend"],
        ratios=[0.15],
        selections=["hkvd", "random"],
        max_tokens=4,
        progress=False,
    )
    labels = ["full_prefill", "full_reuse", "cacheblend@0.15 hkvd", "cacheblend@0.15 random"]
    assert [s.label for s in report.settings] == labels
    assert asked == [(0.15, "hkvd"), (0.15, "random")] * 3
    with (tmp_path / "out" / "summary.csv").open() as file:
        table = {row["setting"]: row for row in csv.DictReader(file)}
    assert list(table) == labels
    assert [table[label]["selection"] for label in labels] == ["", "", "hkvd", "random"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [row["selection"] for row in summary["rows"]] == [None, None, "hkvd", "random"]
    predictions = (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()
    selections = [json.loads(line)["selection"] for line in predictions]
    assert selections == [None, None, "hkvd", "random"] * 3
    assert (tmp_path / "out" / "quality_vs_ttft.png").exists()
    # The engine used each: the same budget picked at random leaves more of full reuse's
    # deviation than HKVD's pick of the most deviating tokens, question by question.
    deviations: dict[str, list[float]] = {}
    for o in report.outcomes:
        deviations.setdefault(o.setting.label, []).append(o.kv_deviation)
    for hkvd, random in zip(deviations[labels[2]], deviations[labels[3]], strict=True):
        assert hkvd < 0.8 * random
