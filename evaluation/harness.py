"""`evaluate()`: answer a dataset's questions with an in-process engine in every setting, then
summarize, write the CSV, JSON, per-question JSONL and PNG, and return a typed report."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from engine.engine import Engine
from engine.errors import PromptTooLongError
from evaluation.dataset import DatasetError, Record, load_corpus, load_dataset
from evaluation.options import EvalOptions
from evaluation.plot import plot_tradeoff, require_matplotlib
from evaluation.report import (
    Row,
    overall,
    summarize,
    write_csv,
    write_json,
    write_outcomes,
)
from evaluation.runner import REFERENCE, Outcome, Setting, answer_record, request_for, settings_for

log = logging.getLogger("evaluation")

SUMMARY_CSV = "summary.csv"
SUMMARY_JSON = "summary.json"
OUTCOMES_JSONL = "predictions.jsonl"
PLOT_PNG = "quality_vs_ttft.png"


@dataclass(frozen=True)
class EvalReport:
    options: EvalOptions
    settings: list[Setting]
    rows: list[Row]  # per setting over all questions, then per setting and kind
    outcomes: list[Outcome]  # per question and setting
    files: dict[str, Path] = field(default_factory=dict)  # what was written, by kind
    wall_s: float = 0.0

    def row(self, label: str, kind: str = "all") -> Row:
        """The row of one setting (e.g. "cacheblend@0.15"), over all questions by default."""
        for row in self.rows:
            if row.setting == label and row.kind == kind:
                return row
        raise KeyError(f"no row for {label!r} and kind {kind!r}")


def _check_lengths(engine: Engine, records: Sequence[Record], contexts, max_tokens: int) -> None:
    """Refuse the run before any answer when a prompt does not fit the engine."""
    for record, passages in zip(records, contexts, strict=True):
        try:
            engine.layout(request_for(record, passages, REFERENCE, max_tokens))
        except PromptTooLongError as exc:
            raise DatasetError(f"record {record.id!r}: {exc}") from None


def evaluate(dataset: Path | str, out_dir: Path | str | None = None, **options: Any) -> EvalReport:
    """Evaluate the JSONL `dataset` with EvalOptions(**options); with `out_dir`
    also write summary.csv, summary.json, predictions.jsonl and quality_vs_ttft.png there.

    Raises pydantic.ValidationError for bad options, DatasetError for a bad dataset or corpus
    (naming the line and field) or a prompt that does not fit the model, MissingDependencyError
    when the plot is asked for without matplotlib.
    """
    opts = EvalOptions(**options)
    if out_dir is not None and opts.plot:
        require_matplotlib()
    records = load_dataset(Path(dataset), opts.limit, require_passages=not opts.retrieval)
    documents = load_corpus(opts.corpus) if opts.corpus is not None else None
    started = time.perf_counter()
    if opts.retrieval:
        # Imported here: the retriever loads faiss and sentence-transformers.
        from evaluation.retrieval import corpus_of, retrieve

        contexts = retrieve(records, documents or corpus_of(records), opts.top_k, opts.progress)
    else:
        contexts = [list(record.passages) for record in records]
    settings = settings_for(opts.modes, opts.ratios, opts.selections)
    engine = Engine.from_pretrained(
        opts.model, device=opts.device, dtype=opts.dtype, max_num_seqs=1
    )
    model_name = engine.model_name
    try:
        _check_lengths(engine, records, contexts, opts.max_tokens)
        outcomes: list[Outcome] = []
        for record, passages in tqdm(
            list(zip(records, contexts, strict=True)),
            desc=f"eval ({len(settings)} settings)",
            unit="question",
            disable=not opts.progress,
        ):
            outcomes.extend(
                answer_record(
                    engine,
                    record,
                    passages,
                    settings,
                    opts.max_tokens,
                    opts.chunk_order,
                    opts.teacher_forced_tokens,
                )
            )
    finally:
        engine.close()
    rows = summarize(outcomes)
    report = EvalReport(opts, settings, rows, outcomes, wall_s=time.perf_counter() - started)
    if out_dir is not None:
        report.files.update(write_outputs(report, Path(out_dir), model_name))
    return report


def write_outputs(report: EvalReport, out_dir: Path, model_name: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "csv": out_dir / SUMMARY_CSV,
        "json": out_dir / SUMMARY_JSON,
        "predictions": out_dir / OUTCOMES_JSONL,
    }
    write_csv(report.rows, files["csv"])
    write_outcomes(report.outcomes, files["predictions"])
    summary = {
        "model": model_name,
        "options": report.options.model_dump(mode="json"),
        "questions": len({o.record_id for o in report.outcomes}),
        "settings": [s.label for s in report.settings],
        "wall_s": round(report.wall_s, 3),
    }
    write_json(summary, report.rows, files["json"])
    if report.options.plot:
        files["plot"] = out_dir / PLOT_PNG
        title = f"{report.options.model}: quality against TTFT ({summary['questions']} questions)"
        plot_tradeoff(overall(report.rows), files["plot"], title)
    return files
