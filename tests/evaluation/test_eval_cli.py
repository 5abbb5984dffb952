"""`ragblend eval` end to end as a real process on demo questions and the demo model: the
outputs exist and agree with the blend's invariants; bad input exits non-zero with a message."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.contract import Selection
from demo import MODEL_DIR
from engine.types import ChunkOrder, Mode
from evaluation.cli import FLAGS
from evaluation.dataset import Record
from evaluation.options import EvalOptions
from ragblend.cli import build_parser
from tests.service_process import service_env

REPO_ROOT = Path(__file__).resolve().parents[2]
KINDS = ("single", "multi", "context")


@pytest.fixture(scope="module")
def demo_set(tmp_path_factory) -> Path:
    """Six held-out demo questions, two of each kind, as written by the converter."""
    path = tmp_path_factory.mktemp("eval-data") / "demo.jsonl"
    done = subprocess.run(
        [sys.executable, "scripts/convert_dataset.py", "demo", "--count", "6", "-o", str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return path


def test_eval_writes_outputs_where_full_prefill_agrees_with_itself_and_r1_equals_it(
    demo_set, tmp_path
):
    out = tmp_path / "out"
    command = [
        *(sys.executable, "-m", "ragblend", "eval", str(demo_set)),
        *("--model", str(MODEL_DIR), "--out", str(out), "--max-tokens", "12"),
        *("--modes", "full_reuse", "cacheblend", "--ratios", "0.15", "1"),
    ]
    done = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=service_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cacheblend@0.15" in done.stdout and "by kind of question" in done.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["questions"] == 6
    assert summary["settings"] == ["full_prefill", "full_reuse", "cacheblend@0.15", "cacheblend@1"]
    rows = {(r["setting"], r["kind"]): r for r in summary["rows"]}
    assert set(rows) == {(s, k) for s in summary["settings"] for k in ("all", *KINDS)}
    full, r1 = rows["full_prefill", "all"], rows["cacheblend@1", "all"]
    assert full["agreement"] == 1.0 and full["kv_deviation"] == 0.0
    assert r1["agreement"] == 1.0 and r1["kv_deviation"] < 1e-9
    for score in ("exact_match", "f1", "rouge_l"):
        assert r1[score] == full[score]
    assert rows["full_reuse", "all"]["kv_deviation"] > 0.01  # no cross-chunk attention at all
    # Teacher-forced: full prefill's own answer after its own KV, r = 1's KV is the same.
    assert full["tf_kl"] == 0.0 and full["tf_argmax_agreement"] == 1.0
    assert r1["tf_kl"] < 1e-6 and r1["tf_argmax_agreement"] == 1.0
    assert rows["full_reuse", "all"]["tf_kl"] > 100 * r1["tf_kl"]
    assert full["exact_match"] > 0.5  # the demo model reads its passages
    assert full["ttft_median_ms"] > 0 and full["ttft_p90_ms"] >= full["ttft_median_ms"]

    with (out / "summary.csv").open() as file:
        table = list(csv.DictReader(file))
    assert len(table) == len(summary["rows"])
    assert {r["recompute_ratio"] for r in table if r["mode"] == "cacheblend"} == {"0.15", "1.0"}
    assert {"tf_kl", "tf_argmax_agreement"} <= set(table[0])
    predictions = [
        json.loads(line) for line in (out / "predictions.jsonl").read_text().split("\n") if line
    ]
    assert len(predictions) == 6 * 4
    by_question = {}
    for p in predictions:
        by_question.setdefault(p["record_id"], {})[(p["mode"], p["recompute_ratio"])] = p
    for answers in by_question.values():
        assert (
            answers["cacheblend", 1.0]["prediction"] == answers["full_prefill", None]["prediction"]
        )
    assert (out / "quality_vs_ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def run_cli(*argv: str) -> int:
    args = build_parser().parse_args(["eval", *argv])
    return args.run(args)


def test_a_bad_dataset_line_exits_2_naming_line_and_field(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    good = Record(question="Q?", passages=["p"], answers=["a"]).model_dump_json()
    path.write_text(good + "\n" + '{"question": "Q?", "passages": ["p"]}\n')
    assert run_cli(str(path), "--model", str(MODEL_DIR), "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "ragblend eval: error:" in err and "bad.jsonl:2: answers: Field required" in err
    assert not (tmp_path / "summary.csv").exists()


def test_bad_options_exit_2_naming_the_flag(tmp_path, capsys):
    path = tmp_path / "data.jsonl"
    path.write_text(Record(question="Q?", passages=["p"], answers=["a"]).model_dump_json() + "\n")
    assert run_cli(str(path), "--model", str(MODEL_DIR), "--ratios", "0.1", "1.5") == 2
    assert "--ratios: Input should be less than or equal to 1" in capsys.readouterr().err
    assert run_cli(str(path), "--model", str(MODEL_DIR), "--corpus", str(path)) == 2
    assert (
        "--corpus: Value error, a corpus is only used with retrieval on" in capsys.readouterr().err
    )
    assert run_cli(str(path), "--model", str(MODEL_DIR), "--teacher-forced-tokens", "0") == 2
    assert "--teacher-forced-tokens: Input should be greater than or equal to 1" in (
        capsys.readouterr().err
    )
    assert run_cli(str(path), "--model", str(tmp_path / "no-model"), "--no-plot") == 2
    assert "no-model" in capsys.readouterr().err


def parsed_options(*argv: str) -> EvalOptions:
    args = build_parser().parse_args(["eval", "data.jsonl", "--model", "m", *argv])
    return EvalOptions(**{name: getattr(args, name) for name in FLAGS})


def test_every_option_but_progress_is_a_flag_defaulting_to_the_options_default():
    assert set(FLAGS) == set(EvalOptions.model_fields) - {"progress"}
    assert parsed_options() == EvalOptions(model="m")


def test_the_flags_set_their_options():
    options = parsed_options(
        *("--modes", "full_reuse", "cacheblend", "--ratios", "0.1", "1", "--retrieval"),
        *("--corpus", "docs.jsonl", "--top-k", "3", "--chunk-order", "best_last", "--limit", "2"),
        *("--dtype", "bfloat16", "--no-plot", "--teacher-forced-tokens", "4"),
    )
    assert options.modes == (Mode.FULL_REUSE, Mode.CACHEBLEND) and options.ratios == (0.1, 1.0)
    assert options.retrieval and options.corpus == Path("docs.jsonl") and options.top_k == 3
    assert options.chunk_order is ChunkOrder.BEST_LAST and options.limit == 2
    assert options.dtype == "bfloat16" and not options.plot
    assert options.teacher_forced_tokens == 4
    assert options.selections == ()  # none given: the engine's selection only


def test_selections_takes_every_selection_and_refuses_another_naming_flag_and_value(capsys):
    names = [selection.value for selection in Selection]
    assert parsed_options("--selections", *names).selections == tuple(Selection)
    options = parsed_options("--selections", "hkvd", "weighted")
    assert options.selections == (Selection.HKVD, Selection.WEIGHTED)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        parsed_options("--selections", "hkvd", "best")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --selections: invalid choice: 'best'" in err and "weighted" in err
    with pytest.raises(SystemExit):
        parsed_options("--selections")  # one or more


def test_a_choice_outside_the_options_values_is_refused_by_the_parser():
    for argv in (["--modes", "fast"], ["--chunk-order", "random"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit):
            parsed_options(*argv)


def test_the_help_of_a_flag_is_its_options_description_and_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "passages retrieved per question (default 5)" in help_text
    assert "cacheblend recompute ratios (default 0.05 0.15 0.3 0.5)" in help_text
    assert "--no-plot draw the PNG plot (needs matplotlib); --no-plot skips it" in help_text
    assert "token selections to compare, each at every ratio (default: the engine's own)" in (
        help_text
    )
    assert "(default )" not in help_text
