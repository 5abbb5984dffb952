"""Penalties through the engine service, a real process on 127.0.0.1 whose default penalties
are set: 422 for values out of range, the default for unset fields, a request's own values."""

from __future__ import annotations

import signal

import pytest
from pydantic import ValidationError

from engine.api.settings import EngineSettings
from tests.service_process import start_service

QUESTION = {"question": "where is the sol of kalo?", "max_tokens": 12, "mode": "full_prefill"}


@pytest.fixture(scope="module")
def service(checkpoint_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-penalties")
    proc = start_service(
        "engine",
        [
            "--model",
            checkpoint_dir("llama"),
            "--store-path",
            str(tmp / "kv"),
            "--max-num-seqs",
            "2",
            "--repetition-penalty",
            "1.8",
        ],
        tmp / "engine.log",
    )
    yield proc
    assert proc.stop() in (0, -signal.SIGTERM), proc.log()[-3000:]


def generate(service, **fields) -> str:
    with service.client() as client:
        reply = client.post("/v1/generate", json={**QUESTION, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()["text"]


def test_unset_penalties_take_the_engines_settings_and_a_request_overrides_them(service):
    defaulted = generate(service)
    assert generate(service, repetition_penalty=1.8) == defaulted
    assert generate(service, repetition_penalty=1.0) != defaulted


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.01),
        ("presence_penalty", -3),
        ("frequency_penalty", 2.5),
        ("repetition_penalty", 0),
        ("repetition_penalty", 2.2),
        ("repetition_penalty", "1.1"),
    ],
)
def test_penalties_out_of_range_get_422_naming_the_field(service, field, value):
    with service.client() as client:
        reply = client.post("/v1/generate", json={**QUESTION, field: value})
    assert reply.status_code == 422, reply.text
    assert field in reply.json()["detail"]


@pytest.mark.parametrize(
    ("setting", "value"),
    [("frequency_penalty", 3.0), ("presence_penalty", -2.5), ("repetition_penalty", 0.0)],
)
def test_a_default_penalty_out_of_range_is_a_settings_error_naming_it(setting, value):
    with pytest.raises(ValidationError, match=setting):
        EngineSettings(model="m", **{setting: value})
