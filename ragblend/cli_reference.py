"""The CLI reference, docs/cli.md, rendered from the parsers themselves (each command's usage,
description and options); `python -m ragblend.cli_reference > docs/cli.md` rewrites it."""

from __future__ import annotations

import argparse
import re

from engine.model.gguf import build_parser as gguf_parser
from ragblend.cli import build_parser

GGUF = "python -m engine.model.gguf"
REGENERATE = "python -m ragblend.cli_reference > docs/cli.md"
# A help text's closing parenthesis when it states the default: "(default 8002)", "(required)".
_DEFAULT = re.compile(r"^(?:default:? (?P<value>.*)|(?P<required>required))$", re.DOTALL)

INTRO = f"""\
<!-- Generated from the parsers by `{REGENERATE}` (`make docs`); do not edit:
tests/ragblend/test_cli_reference.py fails when this page differs from what they generate. -->

# Command line

Every option of every command, as its `--help` gives it. The flags of `ragblend engine`,
`ragblend retriever` and `ragblend gateway` are their settings classes' fields: `--queue-depth`
overrides `RAGBLEND_ENGINE_QUEUE_DEPTH`, and a flag not given leaves the environment variable,
else the default shown, in force (the settings tables: [engine](engine.md),
[retriever](retriever.md), [gateway](gateway.md)). Every command also takes `-h`/`--help`.
"""


def render() -> str:
    """The whole page: the commands' summary, then a section per command."""
    root = build_parser()
    (commands,) = [a for a in root._actions if isinstance(a, argparse._SubParsersAction)]
    lines = [INTRO, "| command | what it does |", "|---|---|"]
    lines += [
        f"| [`ragblend {c.dest}`](#ragblend-{c.dest}) | {_cell(c.help)} |"
        for c in commands._choices_actions
    ]
    lines.append(f"| [`{GGUF}`](#python--m-enginemodelgguf) | convert a GGUF file ahead of time |")
    for parser in [root, *commands.choices.values(), gguf_parser()]:
        lines += ["", *_section(parser)]
    return "\n".join(lines) + "\n"


def _section(parser: argparse.ArgumentParser) -> list[str]:
    positionals = " ".join(_value(a) for a in parser._actions if not a.option_strings)
    lines = [
        f"## `{parser.prog}`",
        "",
        "```",
        f"{parser.prog} [options] {positionals}".rstrip(),
        "```",
    ]
    paragraphs = re.split(r"\n\s*\n", parser.description or "")
    lines += ["\n" + " ".join(p.split()) for p in paragraphs if p.strip()]
    rows = [
        _row(a)
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
    ]
    if rows:
        lines += ["", "| option | value | default | meaning |", "|---|---|---|---|", *rows]
    return lines


def _row(action: argparse.Action) -> str:
    meaning, default = _split_default(action.help or "")
    if default is None:
        default = _parser_default(action)
    names = ", ".join(map(_code, action.option_strings)) or _code(_value(action))
    value = _value(action) if action.option_strings and action.nargs != 0 else ""
    return f"| {names} | {_code(value)} | {_cell(default)} | {_cell(meaning)} |"


def _split_default(text: str) -> tuple[str, str | None]:
    """A help text without its closing parenthesis about the default, and that default: the
    settings flags default to None in the parser and say their field's default there."""
    if not text.endswith(")"):
        return text, None
    depth = 0
    for start in range(len(text) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(text[start], 0)
        if depth == 0:
            break
    said = _DEFAULT.match(text[start + 1 : -1])
    if said is None:
        return text, None
    return text[:start].rstrip(), said["value"] if said["required"] is None else "required"


def _parser_default(action: argparse.Action) -> str:
    default = action.default
    if action.required and action.option_strings:
        return "required"
    if default is None or default is argparse.SUPPRESS or action.nargs == 0:
        return ""  # a switch's default is its absence
    if isinstance(default, list):
        return " ".join(map(str, default))
    return str(default)


def _value(action: argparse.Action) -> str:
    """What follows the flag, as argparse's usage writes it ("PORT", "{cpu,cuda}", "A [A ...]")."""
    if action.metavar is not None:
        metavar = str(action.metavar)
    elif action.choices is not None:
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        metavar = action.dest.upper() if action.option_strings else action.dest
    if action.nargs == "+":
        return f"{metavar} [{metavar} ...]"
    if action.nargs == "*":
        return f"[{metavar} ...]"
    if action.nargs == "?":
        return f"[{metavar}]"
    if action.nargs == argparse.PARSER:
        return f"{metavar} ..."
    return metavar


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if text else ""


def _cell(text: str | None) -> str:
    """Text that stays in its table cell."""
    return " ".join((text or "").split()).replace("|", "\\|")


if __name__ == "__main__":
    print(render(), end="")
