"""Engine settings: an engine reachable beyond loopback needs the internal token, which is
read from either variable and never shown; the SSD tier's KV encoding is one of the codec's;
the memory tiers' eviction policy reaches the KV store's configuration."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.api.main import kv_store_config
from engine.api.settings import EngineSettings
from kvstore import codec
from kvstore.eviction import POLICIES


def test_an_engine_beyond_loopback_without_a_token_refuses_to_start(monkeypatch):
    monkeypatch.delenv("RAGBLEND_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("RAGBLEND_ENGINE_INTERNAL_TOKEN", raising=False)
    with pytest.raises(ValidationError, match="RAGBLEND_INTERNAL_TOKEN"):
        EngineSettings(model="m", host="0.0.0.0")
    assert EngineSettings(model="m", host="0.0.0.0", internal_token="t").internal_token == "t"
    assert EngineSettings(model="m", host="127.0.0.1").internal_token is None


@pytest.mark.parametrize("variable", ["RAGBLEND_ENGINE_INTERNAL_TOKEN", "RAGBLEND_INTERNAL_TOKEN"])
def test_the_token_comes_from_either_variable_and_is_never_shown(monkeypatch, variable):
    monkeypatch.setenv(variable, "sesame-4711")
    settings = EngineSettings(model="m", host="0.0.0.0")
    assert settings.internal_token == "sesame-4711"
    assert "sesame-4711" not in repr(settings) and "sesame-4711" not in str(settings)


def test_kv_encoding_defaults_to_int8_and_takes_each_codec_encoding_from_the_environment(
    monkeypatch,
):
    monkeypatch.delenv("RAGBLEND_ENGINE_KV_ENCODING", raising=False)
    assert EngineSettings(model="m").kv_encoding == "int8"
    for encoding in codec.ENCODINGS:
        monkeypatch.setenv("RAGBLEND_ENGINE_KV_ENCODING", encoding)
        assert EngineSettings(model="m").kv_encoding == encoding
    monkeypatch.setenv("RAGBLEND_ENGINE_KV_ENCODING", "int4")
    with pytest.raises(ValidationError, match="kv_encoding"):
        EngineSettings(model="m")


def test_kv_cache_policy_defaults_to_tinylfu_and_reaches_the_store_config(monkeypatch):
    monkeypatch.delenv("RAGBLEND_ENGINE_KV_CACHE_POLICY", raising=False)
    default = EngineSettings(model="m")
    assert default.kv_cache_policy == "tinylfu"
    assert kv_store_config(default, "fp", "cpu").memory_policy == "tinylfu"
    for policy in POLICIES:
        monkeypatch.setenv("RAGBLEND_ENGINE_KV_CACHE_POLICY", policy)
        settings = EngineSettings(model="m")
        assert kv_store_config(settings, "fp", "cpu").memory_policy == policy
    monkeypatch.setenv("RAGBLEND_ENGINE_KV_CACHE_POLICY", "lfu")
    with pytest.raises(ValidationError, match="kv_cache_policy"):
        EngineSettings(model="m")
