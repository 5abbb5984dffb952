"""The engine's public API: what the package exports resolves, and importing one module of the
package loads no other (the GGUF converter runs as `python -m engine.model.gguf`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import engine
from tests.service_process import REPO_ROOT


def test_the_readme_import_works_and_every_export_resolves():
    from engine import Chunk, Engine, GenerateRequest, Mode

    assert Engine.__module__ == "engine.engine" and Mode.CACHEBLEND == "cacheblend"
    assert GenerateRequest(question="q", chunks=(Chunk("a", "b"),)).chunks[0].id == "a"
    for name in engine.__all__:
        assert getattr(engine, name).__name__ == name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        engine.Nope  # noqa: B018


def test_importing_one_module_of_the_package_loads_not_the_whole_engine():
    code = "import sys, engine.types; print('engine.engine' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
