"""Sampling defaults: a request's own value, else the engine's setting, else the checkpoint's
generation_config.json (as vLLM's --generation-config auto), else greedy without penalties."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.engine import Engine
from engine.types import GREEDY, GenerateRequest, GenerationDefaults, Mode

MODEL_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def with_generation_config(checkpoint_dir, tmp_path_factory):
    """The tiny llama checkpoint with a generation_config.json that sets sampling defaults."""
    path = tmp_path_factory.mktemp("generation-config") / "llama"
    shutil.copytree(checkpoint_dir("llama"), path)
    config = path / "generation_config.json"
    given = json.loads(config.read_text()) if config.exists() else {}
    config.write_text(json.dumps({**given, **MODEL_DEFAULTS, "do_sample": True}))
    return str(path)


def request(**overrides) -> GenerateRequest:
    return GenerateRequest(
        question="which vo is zuka?", mode=Mode.FULL_PREFILL, max_tokens=8, seed=7, **overrides
    )


def test_a_checkpoint_without_sampling_defaults_decodes_greedily(engine_for):
    engine = engine_for("llama")
    assert engine.loaded.generation_defaults == GenerationDefaults()
    assert request().sampling(engine.defaults)[:2] == (GREEDY.temperature, GREEDY.top_p)


def test_the_checkpoints_generation_config_fills_what_a_request_leaves_out(with_generation_config):
    engine = Engine.from_pretrained(with_generation_config)
    try:
        assert engine.loaded.generation_defaults == GenerationDefaults(**MODEL_DEFAULTS)
        temperature, top_p, penalties = request().sampling(engine.defaults)
        assert (temperature, top_p, penalties.repetition) == (0.7, 0.9, 1.3)
        # Same seed, same tokens: the defaults are what an explicit request would have sent.
        defaulted = engine.generate(request()).token_ids
        explicit = engine.generate(
            request(temperature=0.7, top_p=0.9, repetition_penalty=1.3)
        ).token_ids
        assert defaulted == explicit
        assert request(temperature=0.0).sampling(engine.defaults)[0] == 0.0  # the request wins
    finally:
        engine.close()


def test_the_engines_setting_wins_over_the_checkpoints(with_generation_config):
    engine = Engine.from_pretrained(
        with_generation_config, generation_defaults=GenerationDefaults(temperature=0.0)
    )
    try:
        temperature, top_p, penalties = request().sampling(engine.defaults)
        assert (temperature, top_p, penalties.repetition) == (0.0, 0.9, 1.3)
    finally:
        engine.close()
