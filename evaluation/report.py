"""Summarizes per-question outcomes into one row per setting (and per kind of question), and
writes them: summary CSV, JSON report, per-question JSONL and a printed table."""

from __future__ import annotations

import csv
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from evaluation.runner import Outcome, Setting

ALL_KINDS = "all"
DIGITS = 6  # of the means written out: more than any table shows


@dataclass(frozen=True)
class Row:
    """Mean scores of one setting over the questions of one kind (or all of them)."""

    setting: str  # e.g. cacheblend@0.15, or cacheblend@0.15 weighted with --selections
    mode: str
    recompute_ratio: float | None
    selection: str | None  # None: not cacheblend, or the engine's selection
    kind: str
    questions: int
    exact_match: float
    f1: float
    rouge_l: float
    agreement: float
    kv_deviation: float
    tf_kl: float  # teacher-forced KL(full ‖ setting), nats per answer position
    tf_argmax_agreement: float
    ttft_median_ms: float
    ttft_p90_ms: float


def _row(setting: Setting, kind: str, outcomes: Sequence[Outcome]) -> Row:
    ttft_ms = [o.ttft_s * 1000 for o in outcomes]

    def mean(name: str) -> float:
        return round(statistics.fmean(getattr(o, name) for o in outcomes), DIGITS)

    return Row(
        setting=setting.label,
        mode=setting.mode.value,
        recompute_ratio=setting.recompute_ratio,
        selection=None if setting.selection is None else setting.selection.value,
        kind=kind,
        questions=len(outcomes),
        exact_match=mean("exact_match"),
        f1=mean("f1"),
        rouge_l=mean("rouge_l"),
        agreement=mean("agreement"),
        kv_deviation=mean("kv_deviation"),
        tf_kl=mean("tf_kl"),
        tf_argmax_agreement=mean("tf_argmax_agreement"),
        ttft_median_ms=round(float(np.median(ttft_ms)), 3),
        ttft_p90_ms=round(float(np.percentile(ttft_ms, 90)), 3),
    )


def summarize(outcomes: Sequence[Outcome]) -> list[Row]:
    """Rows in the settings' order: all questions first, then each kind (when records have
    kinds) in the order they first appear."""
    groups: dict[tuple[Setting, str], list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        groups[outcome.setting, ALL_KINDS].append(outcome)
        if outcome.kind is not None:
            groups[outcome.setting, outcome.kind].append(outcome)
    return [_row(setting, kind, group) for (setting, kind), group in groups.items()]


def overall(rows: Sequence[Row]) -> list[Row]:
    return [row for row in rows if row.kind == ALL_KINDS]


def write_csv(rows: Sequence[Row], path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[f.name for f in fields(Row)])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in asdict(row).items()})


def write_outcomes(outcomes: Sequence[Outcome], path: Path) -> None:
    with path.open("w") as file:
        for outcome in outcomes:
            line = asdict(outcome) | {
                "mode": outcome.setting.mode.value,
                "recompute_ratio": outcome.setting.recompute_ratio,
                "selection": outcome.setting.selection,
            }
            del line["setting"]
            file.write(json.dumps(line) + "\n")


def write_json(summary: dict[str, Any], rows: Sequence[Row], path: Path) -> None:
    path.write_text(json.dumps(summary | {"rows": [asdict(r) for r in rows]}, indent=2) + "\n")


def _scores(row: Row) -> list[str]:
    return [f"{row.exact_match:.3f}", f"{row.f1:.3f}", f"{row.rouge_l:.3f}", f"{row.agreement:.3f}"]


def tables(rows: Sequence[Row], title: str) -> list[Table]:
    """All questions with KV deviation, teacher-forced KL and argmax agreement and TTFT, then
    (when records have kinds) each kind."""
    overall_rows = overall(rows)
    first = Table(title=title)
    first.add_column("setting", no_wrap=True)
    for name in (
        "n",
        "EM",
        "F1",
        "ROUGE-L",
        "agree",
        "KV dev",
        "TF KL",
        "TF agree",
        "TTFT p50",
        "p90 ms",
    ):
        first.add_column(name, justify="right")
    for row in overall_rows:
        first.add_row(
            row.setting,
            str(row.questions),
            *_scores(row),
            f"{row.kv_deviation:.4f}",
            f"{row.tf_kl:.4f}",
            f"{row.tf_argmax_agreement:.3f}",
            f"{row.ttft_median_ms:.1f}",
            f"{row.ttft_p90_ms:.1f}",
        )
    kinds = list(dict.fromkeys(row.kind for row in rows if row.kind != ALL_KINDS))
    # Stable: each kind's settings stay in the order they were run.
    by_kind = sorted(
        (row for row in rows if row.kind != ALL_KINDS), key=lambda r: kinds.index(r.kind)
    )
    if not by_kind:
        return [first]
    second = Table(title="by kind of question")
    second.add_column("kind", no_wrap=True)
    second.add_column("setting", no_wrap=True)
    for name in ("n", "EM", "F1", "ROUGE-L", "agree", "TF KL"):
        second.add_column(name, justify="right")
    for row in by_kind:
        second.add_row(row.kind, row.setting, str(row.questions), *_scores(row), f"{row.tf_kl:.4f}")
    return [first, second]


def print_table(rows: Sequence[Row], title: str, console: Console | None = None) -> None:
    # Wide enough for every column when the output is a file or a pipe (rich assumes 80).
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    for part in tables(rows, title):
        console.print(part)
