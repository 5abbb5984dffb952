"""The CLI flags of every service are derived from its settings class, so a setting is
declared once and every setting has a flag."""

from __future__ import annotations

import argparse
import logging

import pytest

from common.contract import Selection
from common.serving import QuietProbesFilter, add_settings_flags, settings_from_args
from engine.api.settings import EngineSettings
from gateway.settings import GatewaySettings
from ragblend.cli import build_parser
from retriever.settings import RetrieverSettings

SETTINGS = {"engine": EngineSettings, "gateway": GatewaySettings, "retriever": RetrieverSettings}


@pytest.mark.parametrize("command", sorted(SETTINGS))
def test_every_setting_of_a_service_has_a_flag_of_its_command(command):
    parser = build_parser()
    args = parser.parse_args([command])
    assert set(SETTINGS[command].model_fields) <= set(vars(args))


def test_a_flag_not_given_leaves_the_env_var_in_force(monkeypatch):
    monkeypatch.setenv("RAGBLEND_ENGINE_MODEL", "from-env")
    monkeypatch.setenv("RAGBLEND_ENGINE_QUEUE_DEPTH", "7")
    args = build_parser().parse_args(["engine", "--queue-depth", "3"])
    settings = settings_from_args(EngineSettings, args, "engine")
    assert (settings.model, settings.queue_depth) == ("from-env", 3)


def test_list_flags_take_comma_separated_values_of_the_item_type():
    args = build_parser().parse_args(["engine", "--model", "m", "--check-layers", "1,2,3"])
    assert args.check_layers == [1, 2, 3]
    args = build_parser().parse_args(["gateway", "--engine-urls", "http://a:1, http://b:2"])
    settings = settings_from_args(GatewaySettings, args, "gateway")
    assert settings.engine_urls == ["http://a:1", "http://b:2"]


def test_a_literal_setting_accepts_only_its_values():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["retriever", "--index", "lsh"])


@pytest.mark.parametrize(("flag", "value"), [("0.3", 0.3), ("0", 0.0), ("auto", "auto")])
def test_a_flag_of_a_number_or_a_literal_takes_either(flag, value):
    args = build_parser().parse_args(["engine", "--model", "m", "--recompute-ratio", flag])
    assert args.recompute_ratio == value
    assert settings_from_args(EngineSettings, args, "engine").recompute_ratio == value


@pytest.mark.parametrize("flag", ["fast", "AUTO", ""])
def test_a_flag_of_a_number_or_a_literal_refuses_anything_else(flag):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engine", "--model", "m", "--recompute-ratio", flag])


def test_every_selection_is_a_choice_of_the_engines_flag():
    args = ["engine", "--model", "m", "--selection"]
    for selection in Selection:
        parsed = build_parser().parse_args([*args, selection.value])
        assert settings_from_args(EngineSettings, parsed, "engine").selection == selection
    with pytest.raises(SystemExit):
        build_parser().parse_args([*args, "oracle"])


def test_the_field_description_and_default_are_the_flag_help():
    parser = argparse.ArgumentParser()
    add_settings_flags(parser, RetrieverSettings)
    help_text = " ".join(parser.format_help().split())
    assert "tokens per chunk (default 512)" in help_text


def test_a_factory_default_and_an_unset_default_read_as_the_flag_takes_them():
    parser = argparse.ArgumentParser()
    add_settings_flags(parser, EngineSettings)
    help_text = " ".join(parser.format_help().split())
    assert "PydanticUndefined" not in help_text and "(default None)" not in help_text
    assert "below 8 layers) (default none)" in help_text  # check_layers: a list by factory
    assert "unset: the controller chooses (default unset)" in help_text


def test_invalid_settings_end_the_command_naming_the_field():
    args = build_parser().parse_args(["engine", "--model", "m", "--max-num-seqs", "0"])
    with pytest.raises(SystemExit, match="max_num_seqs"):
        settings_from_args(EngineSettings, args, "engine")


def access_record(path: str, status: int) -> logging.LogRecord:
    """A record as uvicorn's access log writes it."""
    args = ("127.0.0.1:5000", "GET", path, "1.1", status)
    return logging.LogRecord("uvicorn.access", logging.INFO, "h11", 1, '%s "%s %s" %d', args, None)


@pytest.fixture
def access_level():
    """set(level): the level of uvicorn's access logger, restored afterwards."""
    logger = logging.getLogger("uvicorn.access")
    before = logger.level
    yield logger.setLevel
    logger.setLevel(before)


@pytest.mark.parametrize("path", ["/health", "/metrics", "/ready?verbose=1"])
def test_a_successful_probe_is_kept_off_an_info_access_log(path, access_level):
    access_level(logging.INFO)
    assert not QuietProbesFilter().filter(access_record(path, 200))


def test_a_failing_probe_and_a_real_request_stay_on_the_access_log(access_level):
    access_level(logging.INFO)
    assert QuietProbesFilter().filter(access_record("/health", 503))
    assert QuietProbesFilter().filter(access_record("/v1/generate", 200))


def test_at_debug_a_probe_is_logged_as_a_debug_line(access_level):
    access_level(logging.DEBUG)
    record = access_record("/health", 200)
    assert QuietProbesFilter().filter(record) and record.levelname == "DEBUG"
