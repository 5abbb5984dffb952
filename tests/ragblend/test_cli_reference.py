"""docs/cli.md against the parsers it is generated from: a flag added, removed or reworded
without regenerating the page fails here, and so does a command the page leaves out."""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
from pathlib import Path

from engine.api.settings import EngineSettings
from ragblend.cli import build_parser
from ragblend.cli_reference import REGENERATE, render

REPO_ROOT = Path(__file__).resolve().parents[2]
CLI_MD = REPO_ROOT / "docs" / "cli.md"


def stale_lines(page: str) -> list[str]:
    """The unified diff of docs/cli.md against `page`, empty when they are the same."""
    written = CLI_MD.read_text().splitlines()
    return list(difflib.unified_diff(written, page.splitlines(), "docs/cli.md", "", lineterm=""))


def test_docs_cli_md_is_the_parsers_reference():
    diff = stale_lines(render())
    assert not diff, f"docs/cli.md is stale: run `{REGENERATE}` (or `make docs`)\n" + "\n".join(
        diff[:60]
    )


def test_the_reference_does_not_depend_on_the_terminal_or_the_hash_seed():
    # argparse wraps its help at $COLUMNS and a set's order follows the hash seed: the page,
    # written by the documented command, must be the same on any machine.
    env = dict(os.environ, COLUMNS="37", PYTHONHASHSEED="12345")
    written = subprocess.run(
        [sys.executable, "-m", "ragblend.cli_reference"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert not stale_lines(written)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def section(page: str, heading: str) -> str:
    """The text of docs/cli.md's section under `heading`, up to the next one."""
    return page.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def test_every_subcommand_and_every_option_of_it_is_on_the_page():
    page = CLI_MD.read_text()
    for name, parser in subcommands().items():
        assert f"[`ragblend {name}`](#ragblend-{name})" in page, f"{name} not in the summary"
        text = section(page, f"## `ragblend {name}`")
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in text, f"ragblend {name} {flag} not on the page"


def row(page: str, command: str, flag: str) -> list[str]:
    """The cells of `flag`'s row in the options table of `command`'s section."""
    for line in section(page, f"## `{command}`").splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] == f"`{flag}`":
            return cells
    raise AssertionError(f"no row for {command} {flag}")


def test_a_settings_flag_shows_its_fields_default_where_the_parser_holds_none():
    page = CLI_MD.read_text()
    # The parser's default is None (the environment variable stays in force); the field's is
    # what a flag not given means.
    assert build_parser().parse_args(["engine"]).queue_depth is None
    queue_depth = EngineSettings.model_fields["queue_depth"]
    assert row(page, "ragblend engine", "--queue-depth")[2:] == [
        str(queue_depth.default),
        queue_depth.description,
    ]
    assert row(page, "ragblend engine", "--model")[2] == "required"
    assert row(page, "ragblend engine", "--check-layers")[2] == "none"
