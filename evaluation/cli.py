"""`ragblend eval`: quality of every mode and recompute ratio on your model and JSONL dataset."""

from __future__ import annotations

import argparse
import sys
import types
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from evaluation.options import EvalOptions

# The command always draws its progress bar; only a Python caller of evaluate() turns it off.
FLAGS = tuple(name for name in EvalOptions.model_fields if name != "progress")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="measure answer quality and TTFT of each mode on a dataset",
        description=__doc__.splitlines()[0] + " The format and outputs: docs/eval.md.",
    )
    parser.add_argument("dataset", type=Path, help="JSONL: question, passages, answers[, id, kind]")
    for name in FLAGS:
        add_option_flag(parser, name, EvalOptions.model_fields[name])
    parser.add_argument("--out", type=Path, default=Path("eval-results"), help="output folder")
    parser.set_defaults(run=run)


def add_option_flag(parser: argparse.ArgumentParser, name: str, info: FieldInfo) -> None:
    """The flag of one EvalOptions field, defaulting to the field's default (as a flag value):
    a tuple takes one or more values, an enum or a Literal its choices, a bool is a switch."""
    flag = "--" + name.replace("_", "-")
    if info.annotation is bool:
        switch = "--no-" + flag[2:] if info.default else flag
        action = "store_false" if info.default else "store_true"
        parser.add_argument(switch, dest=name, action=action, help=info.description)
        return
    options = _value_type(info.annotation)
    if info.is_required():
        options["required"] = True
    else:
        options["default"] = _flag_value(info.default)
    parser.add_argument(flag, dest=name, help=_help(info), **options)


def _help(info: FieldInfo) -> str | None:
    """The description, with the default as the services' flags show it (when there is one)."""
    if info.is_required() or info.default in (None, ()):
        return info.description
    default = _flag_value(info.default)
    shown = " ".join(map(str, default)) if isinstance(default, list) else default
    return f"{info.description} (default {shown})" if info.description else f"(default {shown})"


def _value_type(annotation: Any) -> dict[str, Any]:
    """argparse's `type`, `choices` and `nargs` for a field annotation."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _value_type(args[0])
    if origin in (Union, types.UnionType):
        (inner,) = [arg for arg in args if arg is not type(None)]
        return _value_type(inner)
    if origin is tuple:
        return {**_value_type(args[0]), "nargs": "+"}
    if origin is Literal:
        return {"choices": list(args)}
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return {"choices": [member.value for member in annotation]}
    return {"type": annotation}


def _flag_value(default: Any) -> Any:
    """A field default as argparse holds a parsed flag: enums by value, tuples as lists."""
    if isinstance(default, tuple):
        return [_flag_value(item) for item in default]
    return default.value if isinstance(default, Enum) else default


def run(args: argparse.Namespace) -> int:
    from engine.errors import ModelNotFoundError, ModelNotSupportedError
    from evaluation.dataset import DatasetError
    from evaluation.harness import evaluate
    from evaluation.plot import MissingDependencyError
    from evaluation.report import print_table

    try:
        report = evaluate(args.dataset, args.out, **{name: getattr(args, name) for name in FLAGS})
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
