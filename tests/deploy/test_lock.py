"""constraints.txt, the lock `make venv` installs with, pins every dependency of pyproject.toml
(the dev extra included) at a version its specifier allows, and never the project itself."""

from __future__ import annotations

import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy.deploy_files import REPO_ROOT


def pins() -> dict[str, Version]:
    pinned = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line!r}"
            pinned[canonicalize_name(name)] = Version(version)
    return pinned


def requirements() -> list[Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    listed = project["dependencies"] + project["optional-dependencies"]["dev"]
    return [Requirement(text) for text in listed]


def test_every_dependency_and_dev_tool_is_pinned_within_its_specifier():
    pinned = pins()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{requirement.name} is not in constraints.txt: run `make lock`"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {name}=={pinned[name]}, outside {requirement}"
        )


def test_the_lock_holds_neither_the_project_nor_a_build_variant_of_torch():
    pinned = pins()
    assert "ragblend" not in pinned
    assert pinned["torch"].local is None, "a +cpu/+cu pin fails where the index has another build"


def test_make_venv_installs_with_the_lock():
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "CONSTRAINTS := constraints.txt" in makefile
    assert "pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'" in makefile
