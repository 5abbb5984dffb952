"""The layering, read from the imports: no service imports the command line (`ragblend`), the
demo or the evaluation harness; `common` imports no service; the harness (`evaluation`) uses
the services in process but not the command line or the demo."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("engine", "kvstore", "retriever", "gateway")
FORBIDDEN = {
    **{package: {"ragblend", "demo", "evaluation"} for package in SERVICES},
    "common": {"ragblend", "demo", "evaluation", *SERVICES},
    "evaluation": {"ragblend", "demo"},
}


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


def modules(package: str) -> list[Path]:
    found = sorted((REPO_ROOT / package).rglob("*.py"))
    assert found, f"no modules under {package}/"
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_above_its_floor(package):
    offending = {
        str(path.relative_to(REPO_ROOT)): sorted(imported_packages(path) & FORBIDDEN[package])
        for path in modules(package)
    }
    assert {path: names for path, names in offending.items() if names} == {}


def test_the_check_sees_lazy_imports_inside_functions(tmp_path):
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from ragblend.up import run\n    import demo.tiny\n")
    assert imported_packages(module) == {"ragblend", "demo"}
