"""The layering, read from the imports and checked against the tables of docs/architecture.md:
a package imports only the packages its "may import" cell names, and every package has a row;
inside the engine, each subpackage imports only the engine modules its row names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
ANYTHING = "anything"
ROW = re.compile(r"^\|\s*`(?P<folder>[a-z_]+)/`\s*\|.*\|(?P<may_import>[^|]*)\|\s*$")
NAME = re.compile(r"`([a-z_]+)`")
ENGINE_ROW = re.compile(r"^\|\s*`(?P<folder>engine/[a-z_]+)/`\s*\|.*\|(?P<may_import>[^|]*)\|\s*$")
ENGINE_UNIT = re.compile(r"`(engine(?:/[a-z_]+)?)`")


def allowed_imports(markdown: str) -> dict[str, set[str] | None]:
    """Each folder of the table and the packages its "may import" cell names in backticks;
    None where the cell starts with "anything"."""
    table: dict[str, set[str] | None] = {}
    for line in markdown.splitlines():
        row = ROW.match(line)
        if row is None:
            continue
        cell = row["may_import"].strip()
        table[row["folder"]] = None if cell.startswith(ANYTHING) else set(NAME.findall(cell))
    return table


def packages(root: Path) -> list[str]:
    """The top-level folders of the repository that hold Python code."""
    return sorted(
        path.name
        for path in root.iterdir()
        if path.is_dir() and not path.name.startswith(".") and any(path.rglob("*.py"))
    )


def imported_packages(path: Path) -> set[str]:
    """The top-level package of every import in the module, lazy ones inside functions too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def violations(root: Path, table: dict[str, set[str] | None]) -> dict[str, list[str]]:
    """Each module importing one of our packages its folder's row does not allow (or whose
    folder has no row), with the packages at fault."""
    ours = set(packages(root))
    found: dict[str, list[str]] = {}
    for package in sorted(ours):
        if package not in table:
            found[f"{package}/"] = ["no row in the table"]
            continue
        allowed = table[package]
        if allowed is None:
            continue
        for path in sorted((root / package).rglob("*.py")):
            wrong = (imported_packages(path) & ours) - allowed - {package}
            if wrong:
                found[str(path.relative_to(root))] = sorted(wrong)
    return found


def engine_allowed(markdown: str) -> dict[str, set[str] | None]:
    """Each engine subpackage of the table ("engine/blend") and the engine modules or
    subpackages its cell names ("engine/model", "engine/types"); None for "anything"."""
    table: dict[str, set[str] | None] = {}
    for line in markdown.splitlines():
        row = ENGINE_ROW.match(line)
        if row is None:
            continue
        cell = row["may_import"].strip()
        table[row["folder"]] = None if cell.startswith(ANYTHING) else set(ENGINE_UNIT.findall(cell))
    return table


def engine_units(path: Path, engine_dir: Path) -> set[str]:
    """The engine modules and subpackages the module imports, as "engine/<name>"; "engine"
    for a name the package itself exports (`from engine import Engine`: the front)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    units: set[str] = set()

    def unit(name: str) -> str:
        exists = (engine_dir / name).is_dir() or (engine_dir / f"{name}.py").is_file()
        return f"engine/{name}" if exists else "engine"

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            parts = [alias.name.split(".") for alias in node.names]
            units.update(unit(p[1]) if len(p) > 1 else "engine" for p in parts if p[0] == "engine")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "engine":
                continue
            if len(parts) > 1:
                units.add(unit(parts[1]))
            else:
                units.update(unit(alias.name) for alias in node.names)
    return units


def engine_violations(root: Path, table: dict[str, set[str] | None]) -> dict[str, list[str]]:
    """Each module of an engine subpackage importing an engine module its row does not allow
    (or whose subpackage has no row), with the modules at fault."""
    engine_dir = root / "engine"
    found: dict[str, list[str]] = {}
    for sub in sorted(p for p in engine_dir.iterdir() if (p / "__init__.py").is_file()):
        folder = f"engine/{sub.name}"
        if folder not in table:
            found[f"{folder}/"] = ["no row in the table"]
            continue
        allowed = table[folder]
        if allowed is None:
            continue
        for path in sorted(sub.rglob("*.py")):
            wrong = engine_units(path, engine_dir) - allowed - {folder}
            if wrong:
                found[str(path.relative_to(root))] = sorted(wrong)
    return found


def test_every_engine_subpackage_imports_only_what_its_row_allows():
    table = engine_allowed(ARCHITECTURE.read_text())
    assert violations_are_checked(table)
    assert engine_violations(REPO_ROOT, table) == {}


def violations_are_checked(table: dict[str, set[str] | None]) -> bool:
    """The blend loop's row must not allow the scheduling policy, nor the front."""
    blend = table.get("engine/blend")
    return blend is not None and not {"engine/sched", "engine"} & blend


def test_every_package_imports_only_what_its_row_of_the_architecture_table_allows():
    table = allowed_imports(ARCHITECTURE.read_text())
    assert violations(REPO_ROOT, table) == {}


def test_every_row_of_the_table_names_a_folder_of_the_repository():
    table = allowed_imports(ARCHITECTURE.read_text())
    assert sorted(set(table) - {path.name for path in REPO_ROOT.iterdir()}) == []


def test_the_table_names_the_services_floor_so_the_check_is_not_vacuous():
    table = allowed_imports(ARCHITECTURE.read_text())
    assert table["common"] == set()
    assert table["gateway"] is not None and "engine" not in table["gateway"]


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


TABLE = """\
| folder | owns | may import |
|---|---|---|
| `common/` | shared | no service |
| `engine/` | the model | `common` |
| `gateway/` | the API | `common` |
| `tests/` | tests | anything |
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    write(tmp_path, "common/__init__.py", "")
    write(tmp_path, "engine/model.py", "import common.sse\nimport torch\n")
    write(tmp_path, "gateway/app.py", "from common.errors import x\nfrom . import routes\n")
    write(tmp_path, "tests/test_x.py", "import engine.model\nimport gateway.app\n")
    return tmp_path


def test_the_table_is_read_as_an_allowlist_per_folder():
    assert allowed_imports(TABLE) == {
        "common": set(),
        "engine": {"common"},
        "gateway": {"common"},
        "tests": None,
    }


def test_a_tree_that_keeps_to_the_table_passes(tree):
    assert violations(tree, allowed_imports(TABLE)) == {}


def test_a_gateway_import_of_the_engine_fails_as_it_is_not_in_the_gateway_row(tree):
    write(tree, "gateway/routes.py", "def f():\n    from engine.model import run\n")
    assert violations(tree, allowed_imports(TABLE)) == {"gateway/routes.py": ["engine"]}


def test_a_package_without_a_row_fails(tree):
    write(tree, "scripts/tool.py", "import common\n")
    assert violations(tree, allowed_imports(TABLE)) == {"scripts/": ["no row in the table"]}


def test_the_check_sees_lazy_imports_inside_functions(tmp_path):
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from ragblend.up import run\n    import demo.tiny\n")
    assert imported_packages(module) == {"ragblend", "demo"}


ENGINE_TABLE = """\
| folder | owns | may import |
|---|---|---|
| `engine/model/` | the model | `engine/types` |
| `engine/blend/` | the loop | `engine/model`, `engine/types` |
| `engine/sched/` | the policy | `engine/blend`, `engine/types` |
"""


@pytest.fixture
def engine_tree(tmp_path: Path) -> Path:
    write(tmp_path, "engine/__init__.py", "from engine.engine import Engine\n")
    write(tmp_path, "engine/engine.py", "from engine.sched.scheduler import Scheduler\n")
    write(tmp_path, "engine/types.py", "")
    write(tmp_path, "engine/model/__init__.py", "")
    write(tmp_path, "engine/model/layers.py", "from engine.types import Mode\n")
    write(tmp_path, "engine/blend/__init__.py", "")
    write(tmp_path, "engine/blend/loop.py", "from engine.model import layers\n")
    write(tmp_path, "engine/sched/__init__.py", "")
    write(tmp_path, "engine/sched/scheduler.py", "import engine.blend.loop\n")
    return tmp_path


def test_an_engine_tree_that_keeps_to_its_table_passes(engine_tree):
    assert engine_violations(engine_tree, engine_allowed(ENGINE_TABLE)) == {}


def test_the_blend_loop_importing_the_scheduler_or_the_front_fails(engine_tree):
    write(
        engine_tree,
        "engine/blend/check.py",
        "def f():\n    from engine.sched.scheduler import Step\n    from engine import Engine\n",
    )
    assert engine_violations(engine_tree, engine_allowed(ENGINE_TABLE)) == {
        "engine/blend/check.py": ["engine", "engine/sched"]
    }


def test_an_engine_subpackage_without_a_row_fails(engine_tree):
    write(engine_tree, "engine/runner/__init__.py", "")
    assert engine_violations(engine_tree, engine_allowed(ENGINE_TABLE)) == {
        "engine/runner/": ["no row in the table"]
    }
