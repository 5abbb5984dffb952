"""Model loading: families, dtypes, and the fingerprint that keys KV caches."""

from __future__ import annotations

import pytest
import torch

from demo.tiny import FAMILIES, save_random_checkpoint
from engine.model import load_model


@pytest.mark.parametrize("family", FAMILIES)
def test_every_supported_family_loads_through_the_real_path(checkpoint_dir, family):
    loaded = load_model(checkpoint_dir(family))
    assert loaded.model.config.model_type == family.replace("llama3", "llama")
    assert loaded.dtype == torch.float32 and len(loaded.fingerprint) == 32


def test_fingerprint_is_stable_across_loads(checkpoint_dir):
    path = checkpoint_dir("qwen3")
    assert load_model(path).fingerprint == load_model(path).fingerprint


def test_fingerprint_differs_for_other_weights_and_other_dtype(checkpoint_dir, tmp_path):
    path = checkpoint_dir("llama")
    other = save_random_checkpoint(
        "llama", tmp_path / "other", seed=2, initializer_range=0.1, max_positions=1024
    )
    base = load_model(path)
    assert base.fingerprint != load_model(str(other)).fingerprint
    bf16 = load_model(path, dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    assert base.fingerprint != bf16.fingerprint
