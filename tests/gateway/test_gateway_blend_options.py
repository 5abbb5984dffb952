"""The blend options of a request (selection, recompute_ratio "auto", max_recompute_ratio) over
the wire: refused with a 422 at the gateway when invalid, sent on to the engine as given (a
stand-in that records the bodies it gets), and reported back by the real engine in `blend`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.contract import AUTO_RATIO, Selection
from tests.gateway import scripted_engine

CHAT = {"messages": [{"role": "user", "content": "Kessa pass?"}], "max_tokens": 2}
# Each selection but the default hkvd: one left None would be the engine's, not the request's.
ASKED = next(s for s in Selection if s is not Selection.HKVD).value


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"selection": "best"}, "selection"),
        ({"selection": "HKVD"}, "selection"),
        ({"recompute_ratio": "fast"}, "recompute_ratio"),
        ({"recompute_ratio": 1.5}, "recompute_ratio"),
        ({"recompute_ratio": -0.1}, "recompute_ratio"),
        ({"max_recompute_ratio": 0.3}, "max_recompute_ratio"),
        ({"recompute_ratio": 0.2, "max_recompute_ratio": 0.3}, "max_recompute_ratio"),
        ({"recompute_ratio": AUTO_RATIO, "max_recompute_ratio": 1.5}, "max_recompute_ratio"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/query", "/v1/chat/completions"])
def test_invalid_blend_options_are_a_422_naming_the_field(client, route, options, field):
    if route == "/v1/query":
        body = {"question": "Kessa pass?", "max_tokens": 2, **options}
    else:
        body = {**CHAT, "rag": options}
    response = client.post(route, json=body)
    assert response.status_code == 422, response.text
    assert field in response.json()["detail"]


@pytest.fixture(scope="module")
def recording(tmp_path_factory, spawn_gateway) -> Iterator[tuple[str, Path]]:
    """A gateway over one stand-in engine that records each body it gets: (url, record)."""
    tmp = tmp_path_factory.mktemp("recording-engine")
    record = tmp / "bodies.jsonl"
    engine = scripted_engine.start(tmp / "engine.log", "--record", str(record))
    try:
        yield spawn_gateway(engine).url, record
    finally:
        engine.stop()


def sent(http: httpx.Client, record: Path, route: str, body: dict) -> tuple[dict, dict]:
    """(the gateway's answer, the body the engine got) of one request."""
    record.write_text("")
    response = http.post(route, json=body)
    assert response.status_code == 200, response.text
    (line,) = record.read_text().splitlines()
    return response.json(), json.loads(line)


BLEND_OPTIONS = [
    ({"selection": ASKED}, {"selection": ASKED, "recompute_ratio": None}),
    (
        {"recompute_ratio": AUTO_RATIO},
        {"recompute_ratio": AUTO_RATIO, "max_recompute_ratio": None, "selection": None},
    ),
    (
        {"recompute_ratio": AUTO_RATIO, "max_recompute_ratio": 0.25, "selection": ASKED},
        {"recompute_ratio": AUTO_RATIO, "max_recompute_ratio": 0.25, "selection": ASKED},
    ),
    ({"recompute_ratio": 0.4}, {"recompute_ratio": 0.4, "selection": None}),
    ({}, {"recompute_ratio": None, "max_recompute_ratio": None, "selection": None}),
]


@pytest.mark.parametrize(("options", "expected"), BLEND_OPTIONS)
def test_a_query_sends_its_blend_options_to_the_engine(recording, documents, options, expected):
    url, record = recording
    with httpx.Client(base_url=url, timeout=60) as http:
        answer, body = sent(
            http, record, "/v1/query", {"question": "Kessa pass?", "max_tokens": 2, **options}
        )
    assert {name: body[name] for name in expected} == expected
    # The stand-in reports the selection and the chooser as asked; the gateway passes them on.
    assert answer["blend"]["selection"] == (expected["selection"] or Selection.HKVD)
    assert answer["blend"]["chosen_by"] == (
        "auto" if expected["recompute_ratio"] == AUTO_RATIO else "request"
    )


@pytest.mark.parametrize(("options", "expected"), BLEND_OPTIONS)
def test_a_chat_request_sends_its_rag_blend_options_to_the_engine(
    recording, documents, options, expected
):
    url, record = recording
    with httpx.Client(base_url=url, timeout=60) as http:
        _, body = sent(http, record, "/v1/chat/completions", {**CHAT, "rag": options})
    assert {name: body[name] for name in expected} == expected


@pytest.mark.parametrize("selection", [s.value for s in Selection])
def test_the_engine_reports_the_selection_a_query_asked_for(client, selection):
    body = {"question": "Where does the Zorblax river flow?", "max_tokens": 2}
    response = client.post(
        "/v1/query", json={**body, "recompute_ratio": 0.3, "selection": selection}
    )
    assert response.status_code == 200, response.text
    blend = response.json()["blend"]
    assert blend["selection"] == selection and blend["chosen_by"] == "request"


def test_an_auto_query_is_chosen_by_auto_within_its_bound(client):
    body = {"question": "Where does the Zorblax river flow?", "max_tokens": 2, "selection": ASKED}
    auto = {**body, "recompute_ratio": AUTO_RATIO}
    for bound in (None, 0.0):
        bounded = auto if bound is None else {**auto, "max_recompute_ratio": bound}
        response = client.post("/v1/query", json=bounded)
        assert response.status_code == 200, response.text
        blend = response.json()["blend"]
        assert blend["chosen_by"] == "auto" and blend["selection"] == ASKED
        # Some tokens cover a share of the score mass; a bound of 0 leaves none of them.
        assert (blend["recompute_ratio"] > 0) is (bound is None), blend
