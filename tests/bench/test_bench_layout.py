"""bench/ holds only what a documented command runs: every script under it is named by the
Makefile, the docs or the scripts they run, or is a case of `make bench-smoke`, or is imported by
one of those; and the product benchmarks stay small (experiments go to research/)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# The product benchmarks and their harness, all together and one file at a time.
MAX_TOTAL_LINES = 4000
MAX_FILE_LINES = 350


def bench_scripts() -> set[Path]:
    return {path for path in BENCH.rglob("*.py") if "__pycache__" not in path.parts}


def named_by_commands() -> set[Path]:
    """The bench scripts a command in the Makefile, README.md, docs/ or scripts/ names, as
    `bench/NAME.py` or `python -m bench.NAME`."""
    texts = [ROOT / "Makefile", ROOT / "README.md", *ROOT.glob("docs/**/*.md")]
    text = "\n".join(path.read_text() for path in [*texts, *ROOT.glob("scripts/*.sh")])
    paths = {ROOT / name for name in re.findall(r"\bbench/[\w/]+\.py\b", text)}
    modules = re.findall(r"python -m bench\.([\w.]+)", text)
    return paths | {BENCH / (module.replace(".", "/") + ".py") for module in modules}


def smoke_cases(smoke: Path) -> set[Path]:
    """The scripts of the `Case(name, runs, folder="bench")` entries in a smoke runner."""
    scripts = set()
    for node in ast.walk(ast.parse(smoke.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Case":
            values = [arg.value for arg in node.args if isinstance(arg, ast.Constant)]
            values += [k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)]
            folder = values[1] if len(values) > 1 else "bench"
            scripts.add(ROOT / folder / f"{values[0]}.py")
    return scripts


def bench_imports(script: Path) -> set[Path]:
    """The bench modules `script` imports: by their bare name (bench/ is the script's folder on
    sys.path) or as `bench.NAME`."""
    names = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    found = set()
    for name in names:
        for candidate in (BENCH / f"{name}.py", ROOT / (name.replace(".", "/") + ".py")):
            if candidate.is_relative_to(BENCH) and candidate.exists():
                found.add(candidate)
    return found


def reached() -> set[Path]:
    """What the commands run, `make bench-smoke`'s cases, and everything they import."""
    roots = named_by_commands()
    smoke = BENCH / "smoke.py"
    if smoke in roots:
        roots |= smoke_cases(smoke)
    seen: set[Path] = set()
    todo = [path for path in roots if path.exists()]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += bench_imports(path)
    return seen


def test_every_bench_script_is_run_by_a_documented_command_or_imported_by_one():
    orphans = sorted(str(path.relative_to(ROOT)) for path in bench_scripts() - reached())
    assert orphans == [], "no command in the Makefile or docs runs these (move them to research/)"


def test_every_bench_script_a_command_names_exists():
    missing = sorted(str(path.relative_to(ROOT)) for path in named_by_commands() - bench_scripts())
    assert missing == [], "the docs or the Makefile name bench scripts that do not exist"


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_product_benchmarks_stay_under_their_line_budget():
    total = sum(lines(path) for path in bench_scripts())
    assert total < MAX_TOTAL_LINES, f"bench/ holds {total} lines of Python"
    large = {
        str(p.relative_to(ROOT)): lines(p) for p in bench_scripts() if lines(p) > MAX_FILE_LINES
    }
    assert large == {}, f"files over {MAX_FILE_LINES} lines"
