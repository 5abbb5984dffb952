"""`ragblend eval`: quality of every mode and recompute ratio on your model and JSONL dataset."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from engine.types import ChunkOrder, Mode
from evaluation.options import DEFAULT_MODES, DEFAULT_RATIOS


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="measure answer quality and TTFT of each mode on a dataset",
        description=__doc__.splitlines()[0] + " The format and outputs: docs/eval.md.",
    )
    parser.add_argument("dataset", type=Path, help="JSONL: question, passages, answers[, id, kind]")
    parser.add_argument("--model", required=True, help="checkpoint directory (or cached hub id)")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=[m.value for m in Mode],
        default=[m.value for m in DEFAULT_MODES],
        help="modes to compare (full_prefill always runs: it is the reference)",
    )
    parser.add_argument(
        "--ratios",
        nargs="+",
        type=float,
        default=list(DEFAULT_RATIOS),
        help="cacheblend recompute ratios (default %(default)s)",
    )
    parser.add_argument(
        "--retrieval",
        action="store_true",
        help="retrieve each question's passages (top-k) instead of using the record's",
    )
    parser.add_argument(
        "--corpus",
        type=Path,
        help='with --retrieval: JSONL of {"text": ...} documents '
        "(default: every record's passages)",
    )
    parser.add_argument("--top-k", type=int, default=5, help="passages retrieved per question")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per answer")
    parser.add_argument(
        "--teacher-forced-tokens",
        type=int,
        default=16,
        help="tokens of full prefill's greedy answer fed after each setting's KV (1-256)",
    )
    parser.add_argument(
        "--chunk-order",
        choices=[o.value for o in ChunkOrder],
        default=ChunkOrder.BEST_FIRST.value,
        help="best_last: the passages laid out reversed, the first next to the question",
    )
    parser.add_argument("--limit", type=int, help="evaluate only the first N records")
    parser.add_argument("--out", type=Path, default=Path("eval-results"), help="output folder")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine.errors import ModelNotFoundError, ModelNotSupportedError
    from evaluation.dataset import DatasetError
    from evaluation.harness import evaluate
    from evaluation.plot import MissingDependencyError
    from evaluation.report import print_table

    try:
        report = evaluate(
            args.dataset,
            args.out,
            model=args.model,
            modes=args.modes,
            ratios=args.ratios,
            retrieval=args.retrieval,
            corpus=args.corpus,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            teacher_forced_tokens=args.teacher_forced_tokens,
            chunk_order=args.chunk_order,
            limit=args.limit,
            device=args.device,
            dtype=args.dtype,
            plot=not args.no_plot,
        )
    except ValidationError as exc:
        problems = "; ".join(
            f"--{'-'.join(str(p) for p in e['loc'][:1]).replace('_', '-')}: {e['msg']}"
            for e in exc.errors()
        )
        print(f"ragblend eval: error: {problems}", file=sys.stderr)
        return 2
    except (
        DatasetError,
        MissingDependencyError,
        ModelNotFoundError,
        ModelNotSupportedError,
    ) as exc:
        print(f"ragblend eval: error: {exc}", file=sys.stderr)
        return 2
    questions = len({o.record_id for o in report.outcomes})
    print_table(report.rows, f"{args.dataset.name}: {questions} questions")
    for name, path in report.files.items():
        print(f"{name}: {path}")
    return 0
