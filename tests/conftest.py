"""Shared fixtures: tiny random-init checkpoints of every supported family, built once."""

from __future__ import annotations

import pytest

from demo.tiny import save_random_checkpoint

# qwen2 carries a chat template, the others use the plain one; mistral's window is exercised.
FAMILY_OPTIONS = {
    "llama": {},
    "llama3": {},
    "mistral": {},
    "qwen2": {"chat_template": True},
    "qwen3": {},
}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """family -> path of a saved tiny checkpoint (float32, 4 layers, GQA 4:2)."""
    built: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in built:
            path = tmp_path_factory.mktemp(f"ckpt-{family}")
            save_random_checkpoint(
                family,
                path,
                seed=1,
                initializer_range=0.1,
                max_positions=1024,
                **FAMILY_OPTIONS[family],
            )
            built[family] = str(path)
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The tiny llama the service tests serve (gateway, `ragblend up`), with room for
    generations long enough to still be running while a test disconnects or saturates."""
    path = tmp_path_factory.mktemp("served-ckpt")
    save_random_checkpoint("llama", path, seed=1, initializer_range=0.1, max_positions=8192)
    return str(path)
